"""A reshard XLA's SPMD partitioner cannot do: resharding [a, b, -, c] to [b, -, c, a] on a mesh a=4, b=2, c=2
(16 devices), XLA tries one all-to-all for all three dim pairs at once, and its GetAllToAllSharding divides by
the zero that b's 2 tiles over a's 4 make: SIGFPE, the process dies (jax 0.10.2). `crashes_xla` predicts it
from the replay of XLA's reshard; reshard paths (planner, simulator, lowering) go through an intermediate
layout instead, so a plan shardc lowers never asks for it. Each check runs in a process of its own on 16 CPU
devices (the crash needs them)."""
import os
import subprocess
import sys
import textwrap

import pytest

from shardc.cost.reshard import crashes_xla, reshard_collectives
from shardc.cost.reshard_path import reshard_steps
from shardc.sharding import Sharding

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH = {"a": 4, "b": 2, "c": 2}
SHAPE = (4, 2, 8, 16)


def S(*dims: str) -> Sharding:
    return Sharding(tuple(tuple(d.split("+")) if d != "-" else () for d in dims))


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)


JIT = """
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((4, 2, 2), ("a", "b", "c"))
    f = jax.jit(lambda x: x * 1.0, in_shardings=NamedSharding(mesh, P({src})), out_shardings=NamedSharding(mesh, P({dst})))
    f.lower(jax.ShapeDtypeStruct((4, 2, 8, 16), jnp.float32)).compile()
"""


@pytest.mark.parametrize("src, dst, crash", [
    (("a", "b", "-", "c"), ("b", "-", "c", "a"), True),
    (("c", "-", "a", "b"), ("-", "c", "b", "a"), True),
    (("a", "b", "-", "c"), ("b", "c", "-", "a"), False),  # (two pairs at once, each dividing: fine)
    (("-", "-", "b+c", "a"), ("a", "-", "b", "c"), False),
])
def test_the_prediction_is_what_xla_does(src, dst, crash):
    """Pinned against XLA: if a JAX release fixes the partitioner, the crash cases say so here."""
    assert crashes_xla(S(*src), S(*dst), SHAPE, MESH) is crash
    spec = lambda d: ", ".join("None" if x == "-" else repr(tuple(x.split("+"))) for x in d)  # noqa: E731
    r = _run(JIT.format(src=spec(src), dst=spec(dst)))
    assert (r.returncode == -8) is crash, (r.returncode, r.stderr[-2000:])  # -8: SIGFPE
    if not crash:
        assert r.returncode == 0, r.stderr[-2000:]


def test_reshard_paths_avoid_it_and_the_lowered_plan_compiles():
    """The path goes through [a, b, c, -] (an all-to-all over c, then two more), priced as it runs; shardc.auto
    with those shardings compiles on 16 devices, computes the step, and its collectives are the plan's."""
    src, dst = S("a", "b", "-", "c"), S("b", "-", "c", "a")
    steps = reshard_steps(src, dst, SHAPE, 4, MESH)
    assert len(steps) == 2 and steps[-1][0] == dst
    assert not any(crashes_xla(a, b, SHAPE, MESH) for a, b in zip((src,) + tuple(s for s, _ in steps[:-1]),
                                                                    [s for s, _ in steps]))
    assert sum(len(c) for _, c in steps) == len(reshard_collectives(src, dst, SHAPE, 4, MESH))
    r = _run("""
        import warnings; warnings.simplefilter("ignore")
        import jax, jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        import shardc
        mesh = shardc.make_mesh({"a": 4, "b": 2, "c": 2})
        # (a new dtype: an output like an input would be state carried to the next step, held in one layout)
        f = shardc.auto(lambda x: (x * 2).astype(jnp.int32), mesh=mesh, search=False,
                        in_shardings=P("a", "b", None, "c"), out_shardings=P("b", None, "c", "a"))
        x = jnp.arange(4 * 2 * 8 * 16, dtype=jnp.float32).reshape(4, 2, 8, 16)
        assert (f(x) == 2 * x).all()
        rows = {r.quantity: r for r in shardc.check(f.plan(x)).rows}
        print(rows["all-to-all bytes"].predicted, rows["all-to-all bytes"].compiled)
        assert all(r.ok for q, r in rows.items() if q.endswith("bytes") and q != "peak memory bytes"), rows
    """)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    predicted, compiled = (float(x) for x in r.stdout.split()[-2:])
    assert predicted == compiled > 0
