"""The reshard model against XLA, exhaustively: every (src, dst) pair of dim shardings of a shape on a mesh,
plus partial-sum sources (a dot contracting over sharded dims, its result pinned to its natural layout, then
constrained to the target), compiled in batches and compared with `reshard_collectives` kind by kind and
byte for byte.

    python -m bench.reshard_probe [--spaces 2x4:16,32 ...] [--partial-spaces 2x4:16,32 ...] [--show 5]
                                  [--cache FILE]

Spaces are `mesh:shape`, the mesh `2x4` (data=2, model=4) or `2x2x2` (x, y, z); by default all four spaces
(2-D and 3-D shapes on both meshes), partial-sum sources on the 2x4 mesh (2-D, 3-D) and the 2x2x2 mesh
(2-D), and 768 pairs of 4-D shapes on each mesh (where one all-to-all can move several axes). It prints, per space, the pairs whose collectives differ (kind, bytes), whose full-rematerialization
flag differs (XLA's "[SPMD] Involuntary full rematerialization" warning against `is_involuntary_remat`),
and whose collectives differ in mesh axes only, with the first few of each.

Each batch is one program of up to 1024 independent reshards, each under `jax.named_scope(f"rs{i}")`, with
XLA's collective combiners disabled so every collective stays with its reshard; a collective is attributed
to its reshard by the `rs{i}` in its metadata `op_name`, a warning by the op it names. XLA:CPU has no
reduce-scatter (it all-reduces, then slices), so the model is asked with `reduce_scatter=False`. `--cache`
keeps the compiled results in a JSON file keyed by jax version, so the model can be re-checked without
recompiling.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import itertools
import json
import os
import random
import re
import sys
import time
from typing import Iterable, Sequence

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import shardc  # noqa: E402
from shardc.check import INVOLUNTARY_REMAT, xla_log  # noqa: E402
from shardc.fresh_compile import uncached  # noqa: E402
from shardc.cost.hlo import collectives  # noqa: E402
from shardc.cost.reshard import is_involuntary_remat, reshard_collectives  # noqa: E402
from shardc.sharding import Sharding  # noqa: E402

Dims = tuple[tuple[str, ...], ...]
# A case: (source dims, partial axes of the source (mesh order; empty for none), target dims).
Case = tuple[Dims, tuple[str, ...], Dims]
# sorted (kind, bytes, axes, stride: where in its axis a group of part of one axis lies) of each collective
Colls = tuple[tuple[str, int, tuple[str, ...], int], ...]
Observed = tuple[Colls, bool]  # the collectives, and whether XLA fell back to full rematerialization

# Combiners off, so that each collective stays with its reshard; LLVM at -O0 (it only changes the machine
# code, and halves the compile time).
COMPILER_OPTIONS = {
    "xla_disable_hlo_passes": "all-gather-combiner,all-reduce-combiner,cpu-all-reduce-combiner,"
                              "all-to-all-combiner,collective-permute-combiner,reduce-scatter-combiner",
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}
CONTRACTED = 64  # size of the contracted dim of partial-sum sources
SPACES = {"2x4": {"data": 2, "model": 4}, "2x2x2": {"x": 2, "y": 2, "z": 2}}


def shardings(rank: int, axes: Sequence[str]) -> list[Dims]:
    """Every assignment of mesh axes to dims (each axis to at most one dim), in every order within a dim."""
    out = set()
    for assign in itertools.product(range(rank + 1), repeat=len(axes)):  # 0 = unused, d + 1 = dim d
        per = [[a for a, t in zip(axes, assign) if t == d + 1] for d in range(rank)]
        for perms in itertools.product(*[list(itertools.permutations(p)) for p in per]):
            out.add(tuple(tuple(p) for p in perms))
    return sorted(out)


def dims_cases(rank: int, mesh: dict[str, int]) -> list[Case]:
    """Every (src, dst) pair of distinct dim shardings."""
    shs = shardings(rank, tuple(mesh))
    return [(a, (), b) for a in shs for b in shs if a != b]


def sampled_cases(rank: int, mesh: dict[str, int], n: int = 768, seed: int = 0) -> list[Case]:
    """A fixed-seed sample of `n` (src, dst) pairs of distinct dim shardings."""
    return random.Random(seed).sample(dims_cases(rank, mesh), n)


def partial_cases(rank: int, mesh: dict[str, int]) -> list[Case]:
    """Every partial-sum source (dims, and a non-empty set of the unused axes holding partial sums) to every
    dim sharding."""
    shs = shardings(rank, tuple(mesh))
    out = []
    for src in shs:
        free = [a for a in mesh if a not in {x for d in src for x in d}]
        for r in range(1, len(free) + 1):
            for k in itertools.combinations(free, r):
                out.extend((src, k, dst) for dst in shs)
    return out


def _spec(dims: Dims) -> P:
    return P(*[None if not d else (d[0] if len(d) == 1 else d) for d in dims])


def _reshard_fn(mesh, cases: Sequence[Case]):
    """A program resharding each case's input(s): `x * 2` from src to dst, or for a partial-sum source a dot
    contracting over the partial axes whose result is pinned to src, then constrained to dst."""

    def W(x, dims):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, _spec(dims)))

    def f(*xs):
        outs, it = [], iter(xs)
        for i, (src, k, dst) in enumerate(cases):
            with jax.named_scope(f"rs{i}"):
                x = next(it)
                if k:
                    w = next(it)
                    lhs = W(x * 2, src[:-1] + (k,))
                    y = jnp.einsum("...k,kn->...n", lhs, W(w * 2, (k, src[-1])))
                    x = W(y, src)
                outs.append(W(x * 2, dst) * 3)
        return outs

    return f


def _inputs(mesh, shape: Sequence[int], cases: Sequence[Case]):
    avals, shards = [], []
    for src, k, _ in cases:
        if k:
            avals += [jax.ShapeDtypeStruct((*shape[:-1], CONTRACTED), jnp.float32),
                      jax.ShapeDtypeStruct((CONTRACTED, shape[-1]), jnp.float32)]
            shards += [NamedSharding(mesh, _spec(src[:-1] + (k,))), NamedSharding(mesh, _spec((k, src[-1])))]
        else:
            avals.append(jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
            shards.append(NamedSharding(mesh, _spec(src)))
    return avals, shards


def _case_of_param(cases: Sequence[Case]) -> list[int]:
    """Case index of each program parameter (a partial-sum source has two)."""
    return [i for i, (_, k, _) in enumerate(cases) for _ in range(2 if k else 1)]


_RS = re.compile(r'op_name="[^"]*?/rs(\d+)/')
_PARAM = re.compile(r'op_name="xs\[(\d+)\]"')


def _remat_cases(lines: Sequence[str], cases: Sequence[Case]) -> set[int]:
    """Cases XLA reported an involuntary full rematerialization for (the warning names the HLO op, whose
    metadata is the reshard's scope or the program parameter it reshards)."""
    params = _case_of_param(cases)
    out = set()
    for line in lines:
        if INVOLUNTARY_REMAT not in line:
            continue
        m = _RS.search(line)
        if m:
            out.add(int(m.group(1)))
        elif (m := _PARAM.search(line)):
            out.add(params[int(m.group(1))])
        else:
            raise AssertionError(f"an involuntary rematerialization of no known reshard: {line}")
    return out


def compile_cases(mesh_sizes: dict[str, int], shape: Sequence[int], cases: Sequence[Case],
                  batch: int = 1024) -> list[Observed]:
    """The collectives XLA compiles for each case (kind, bytes per device, mesh axes) and whether XLA warned
    of an involuntary full rematerialization for it, batch by batch."""
    mesh = shardc.make_mesh(mesh_sizes)
    out: list[Observed] = []
    for start in range(0, len(cases), batch):
        chunk = cases[start:start + batch]
        avals, shards = _inputs(mesh, shape, chunk)
        outs = [NamedSharding(mesh, _spec(d)) for _, _, d in chunk]
        with uncached(), xla_log() as log:  # (its warnings: compiled afresh)
            compiled = jax.jit(_reshard_fn(mesh, chunk), in_shardings=shards, out_shardings=outs) \
                .lower(*avals).compile(compiler_options=COMPILER_OPTIONS)
        remat = _remat_cases(log, chunk)
        got = collections.defaultdict(list)
        for c in collectives(compiled.as_text(), list(mesh_sizes.items())):
            i = int(c.op_name.split("/rs")[1].split("/")[0]) if "/rs" in c.op_name else -1
            if i < 0:
                raise AssertionError(f"collective {c.name} ({c.op_name!r}) belongs to no reshard")
            got[i].append((c.kind, c.bytes, tuple(c.axes or ()), c.stride))
        out.extend((tuple(sorted(got[i])), i in remat) for i in range(len(chunk)))
    return out


def predict(mesh_sizes: dict[str, int], shape: Sequence[int], case: Case) -> Observed:
    """The model's collectives for a case and its full-rematerialization flag, as `compile_cases` reports them."""
    src, k, dst = case
    s, d = Sharding(src, frozenset(k)), Sharding(dst)
    cs = reshard_collectives(s, d, shape, 4, mesh_sizes, reduce_scatter=False)
    return (tuple(sorted((c.kind, c.bytes, tuple(c.axes), c.stride) for c in cs)),
            is_involuntary_remat(s, d, shape, mesh_sizes))


def kinds_bytes(colls: Colls) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((kind, n) for kind, n, *_ in colls))


def _same_axes(pred: Colls, obs: Colls) -> bool:
    """Equal collectives, mesh axes (and where in an axis a group of part of it lies) included, where XLA's are
    known (`shardc.cost.hlo` reads no axes, `()`, from replica groups over sub-axes such as `{'axis_0':(2)2}`)."""
    rest = list(pred)
    unknown = []
    for c in obs:
        if c in rest:
            rest.remove(c)
        elif c[2] == ():
            unknown.append(c[:2])
        else:
            return False
    return sorted(c[:2] for c in rest) == sorted(unknown)


def mismatches(mesh_sizes: dict[str, int], shape: Sequence[int], cases: Sequence[Case],
               observed: Sequence[Observed]) -> dict[str, list[tuple[Case, Observed, Observed]]]:
    """Cases where the model and XLA differ: in the (kind, bytes) multiset of collectives ("collectives"), in
    the full-rematerialization flag ("remat"), in a collective's mesh axes only ("axes")."""
    bad: dict[str, list] = {"collectives": [], "remat": [], "axes": []}
    for case, obs in zip(cases, observed):
        pred = predict(mesh_sizes, shape, case)
        if kinds_bytes(pred[0]) != kinds_bytes(obs[0]):
            bad["collectives"].append((case, pred, obs))
        elif not _same_axes(pred[0], obs[0]):
            bad["axes"].append((case, pred, obs))
        if pred[1] != obs[1]:
            bad["remat"].append((case, pred, obs))
    return bad


def _space(arg: str) -> tuple[str, dict[str, int], tuple[int, ...]]:
    mesh, shape = arg.split(":")
    return mesh, SPACES[mesh], tuple(int(s) for s in shape.split(","))


def _fmt(dims: Dims, k: Iterable[str] = ()) -> str:
    body = "[" + ", ".join("+".join(d) or "-" for d in dims) + "]"
    return body + (f" partial({','.join(k)})" if k else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spaces", nargs="*", default=["2x4:16,32", "2x4:8,16,32", "2x2x2:16,32", "2x2x2:8,16,32"])
    ap.add_argument("--partial-spaces", nargs="*", default=["2x4:16,32", "2x4:8,16,32", "2x2x2:16,32"])
    ap.add_argument("--sampled-spaces", nargs="*", default=["2x4:8,8,16,16", "2x2x2:8,8,16,16"],
                    help="spaces checked on 768 pairs drawn with a fixed seed (4-D: several all-to-alls in one)")
    ap.add_argument("--show", type=int, default=5, help="mismatches to print per space")
    ap.add_argument("--cache", help="JSON file of compiled results (read if present, written after)")
    args = ap.parse_args()
    cache: dict[str, list] = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache) as f:
            cache = json.load(f)
    jobs = [(s, dims_cases) for s in args.spaces] + [(s, partial_cases) for s in args.partial_spaces] + \
        [(s, sampled_cases) for s in args.sampled_spaces]
    total = 0
    for arg, make in jobs:
        name, mesh, shape = _space(arg)
        cases = make(len(shape), mesh)
        key = f"{jax.__version__}|{arg}|{make.__name__}"
        t0 = time.time()
        if key in cache:
            observed = [(tuple((k, n, tuple(a)) for k, n, a in colls), remat) for colls, remat in cache[key]]
        else:
            with contextlib.redirect_stderr(io.StringIO()):  # XLA's warnings are read, not shown
                observed = compile_cases(mesh, shape, cases)
            cache[key] = observed
        t1 = time.time()
        bad = mismatches(mesh, shape, cases, observed)
        t2 = time.time()
        label = {partial_cases: "partial sources", sampled_cases: "dims, sampled"}.get(make, "dims")
        remat = sum(r for _, r in observed)
        print(f"mesh {name} shape {shape} {label}: {len(cases)} pairs ({remat} by full rematerialization), "
              f"{len(bad['collectives'])} mismatches, {len(bad['remat'])} remat-flag mismatches, "
              f"{len(bad['axes'])} differ in mesh axes only (compile {t1 - t0:.1f} s, "
              f"model {1e6 * (t2 - t1) / len(cases):.0f} us/pair)")
        for what in ("collectives", "remat", "axes"):
            for (src, k, dst), pred, obs in bad[what][:args.show]:
                print(f"   {what}: {_fmt(src, k)} -> {_fmt(dst)}\n      model {list(pred[0])} remat={pred[1]}\n"
                      f"      xla   {list(obs[0])} remat={obs[1]}")
        total += len(bad["collectives"]) + len(bad["remat"])
    print(f"total mismatches: {total}")
    if args.cache:
        with open(args.cache, "w") as f:
            json.dump(cache, f)


if __name__ == "__main__":
    main()
