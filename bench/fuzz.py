"""Fuzz soak: many more generated programs than CI runs, failures recorded and shrunk.

    python bench/fuzz.py [--minutes 30] [--seed 0] [--jobs 1] [--chunk 100] [--max-ops 12]
                         [--const-cotangents] [--pcg] [--loops] [--search] [--out bench/fuzz_failures.jsonl]
                         [--write]

Programs come from `tests/fuzz/fuzzlib.programs` (hypothesis) and are checked by
`fuzzlib.check_program` (sharded == unsharded forward and gradients, compiled shardings == plan,
hints placed as hinted, no conservative fallback, and the compiled collectives equal the plan's, kind
by kind and byte for byte, with no involuntary rematerialization — a program that is right but differs
there counts as "collectives", not "fail"). With `--pcg` they are checked by `pcg_check.check_pcg` instead:
the plan's PCG, random proved rewrites applied, run through its `shard_map` lowering, must equal the unsharded
program with the collectives the PCG names (the substitution engine under the fuzzer). With `--search` the plan
checked is the strategy search's on the program's mesh (`check_program(search=True)`), not the hints' (with
`--pcg` too: the searched plan's PCG). With `--loops` the programs are drawn with more loops and shardc plans and
runs them with their loops restructured (`shardc/loops.py`), checked as above against the program as written.
Work runs in child processes of `--chunk` programs each (seeds `--seed`, `--seed`+1, ...; `--jobs` of them at
once), so a crash inside XLA ends one chunk, not the soak: the program that was running is recorded as a crash
and re-run alone to see whether it reproduces. No chunk starts after `--minutes`; the ones running then finish. A chunk that runs past
CHUNK_TIMEOUT_S is a hang (recorded like a crash) — not the deadline's doing.

Every failure is shrunk (fuzzlib.shrink_program) and appended to `--out` as one JSON line: kind
(fail / crash / upstream / collectives: the first SHRINK_PER_QUANTITY of each differing quantity), error, seed, the program's repr (paste it into
tests/fuzz/test_fuzz_regressions.py) and its pseudo-code. `--write` puts the summary in
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FUZZ_DIR = os.path.join(REPO, "tests", "fuzz")


def _setup_child() -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path[:0] = [REPO, FUZZ_DIR]
    import jax

    jax.config.update("jax_num_cpu_devices", 8)


def _error_kind(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _check(prog: object, mode: str, strict: bool) -> dict:
    """Check one program: its hints' plan (`fuzzlib.check_program`), the substitution engine's (mode "pcg":
    `pcg_check.check_pcg`, random proved rewrites of the plan's PCG, run through its shard_map lowering; "pcg+search":
    of the searched plan's PCG) or the strategy search's plan (mode "search": `check_program(search=True)`).
    Returns the record's fields; raises on a failure."""
    import fuzzlib

    if mode.startswith("pcg"):
        import pcg_check

        # (the engine's random draws — fused ops or not, partial-sum carries, which rewrites — seeded per program:
        # with one seed for all, every program drew the same, unfused, PCG)
        o = pcg_check.check_pcg(prog, seed=zlib.crc32(repr(prog).encode()), search=mode == "pcg+search")
        return dict(kind="ok", error=None, rewrites=list(o.rewrites), unsupported=o.unsupported,
                    collectives=o.collectives, merged=o.merged, rounding=o.rounding)
    loops = mode.startswith("loops")
    o = fuzzlib.check_program(prog, strict_collectives=strict, search=mode in ("search", "loops+search"), loops=loops)
    kind = "upstream" if o.upstream_bug else "collectives" if o.collectives_differ else "ok"
    rec = dict(kind=kind, error=o.upstream_bug or o.collectives_differ, hints=o.hints_checked, reshards=o.reshards,
               sharded=o.sharded_values, values=o.values, rounding=o.rounding)
    if loops:  # (how many of the program's loops were restructured)
        import jax

        from shardc.loops import loop_rewrites

        args = fuzzlib.make_args(prog, 0)
        rec["restructured"] = len(loop_rewrites(jax.make_jaxpr(fuzzlib.program_function(prog))(*args)))
    return rec


def child_chunk(seed: int, count: int, max_ops: int, const_cotangents: bool, mode: str, progress: str,
                results: str) -> None:
    """Check `count` programs drawn with hypothesis seed `seed`; one JSON line per program in `results`."""
    _setup_child()
    import warnings

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzlib

    warnings.simplefilter("ignore")
    out = open(results, "a")
    ops = fuzzlib.LOOP_OPS if mode.startswith("loops") else fuzzlib.OPS + fuzzlib.EXTRA_OPS

    @hseed(seed)
    @settings(max_examples=count, deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(fuzzlib.programs(max_ops=max_ops, const_cotangents=const_cotangents, ops=ops))
    def run(prog: fuzzlib.Program) -> None:
        with open(progress, "w") as f:
            f.write(repr(prog))
        t0 = time.perf_counter()
        rec = {"seed": seed, "program": repr(prog)}
        try:
            rec.update(_check(prog, mode, strict=False))
        except Exception as e:  # noqa: BLE001 - every failure is recorded
            rec.update(kind="fail", error=_error_kind(e))
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        out.write(json.dumps(rec) + "\n")
        out.flush()

    run()


def child_one(program: str, results: str, shrink: bool, mode: str) -> None:
    """Re-run one program (a crash candidate, or a failure to shrink); one JSON line in `results`."""
    _setup_child()
    import warnings

    import fuzzlib
    from fuzzlib import Program, Step  # noqa: F401 - for eval of the repr

    warnings.simplefilter("ignore")
    prog = eval(program)  # noqa: S307 - our own repr
    rec: dict = {"program": program}
    try:
        _check(prog, mode, strict=True)
        rec.update(kind="ok")
    except Exception as e:  # noqa: BLE001
        rec.update(kind="fail", error=_error_kind(e))
        if shrink:
            first = _error_kind(e).split(":")[0]

            def fails(q: fuzzlib.Program) -> bool:
                try:
                    _check(q, mode, strict=True)
                    return False
                except Exception as e2:  # noqa: BLE001
                    return _error_kind(e2).split(":")[0] == first

            small = fuzzlib.shrink_program(prog, fails)
            rec.update(shrunk=repr(small), pseudo=fuzzlib.describe(small))
    with open(results, "a") as f:
        f.write(json.dumps(rec) + "\n")


SHRINK_PER_QUANTITY = 3  # programs whose collectives differ, shrunk per differing quantity
CHUNK_TIMEOUT_S = 3600.0  # a chunk of 100 programs takes 30-120 s; one that runs an hour has hung
HUNG = -999


def _command(args: list[str]) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def _spawn(args: list[str], timeout: float) -> int:
    try:
        return subprocess.run(_command(args), timeout=timeout, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode
    except subprocess.TimeoutExpired:
        return HUNG


def _read_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _describe(program: str) -> str:
    _setup_child()
    import fuzzlib
    from fuzzlib import Program, Step  # noqa: F401

    return fuzzlib.describe(eval(program))  # noqa: S307


def _run_chunks(args: argparse.Namespace, work: str) -> tuple[list[str], list[dict]]:
    """Chunks of programs in child processes, `args.jobs` at a time, until `args.minutes` have passed;
    returns each chunk's results file and the crashes (re-run alone to see whether they reproduce)."""
    deadline = time.time() + 60 * args.minutes
    seed, t0 = args.seed, time.time()
    running: list[tuple[subprocess.Popen, int, str, str, float]] = []
    results_files, crashes = [], []
    while running or time.time() < deadline:
        while time.time() < deadline and len(running) < args.jobs:
            results, progress = (os.path.join(work, f"{kind}-{seed}") for kind in ("results.jsonl", "progress.txt"))
            child = subprocess.Popen(_command(["--child-chunk", str(seed), str(args.chunk), str(args.max_ops),
                                               str(int(args.const_cotangents)), _mode(args), progress,
                                               results]),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            running.append((child, seed, results, progress, time.time()))
            results_files.append(results)
            seed += 1
        time.sleep(0.5)
        for entry in list(running):
            child, s, results, progress, started = entry
            rc = child.poll()
            if rc is None and time.time() - started > CHUNK_TIMEOUT_S:
                child.kill()
                child.wait()
                rc = HUNG
            if rc is None:
                continue
            running.remove(entry)
            done = len(_read_lines(results))
            if rc != 0 and os.path.exists(progress):
                crashed = open(progress).read()
                rc2 = _spawn(["--child-one", crashed, os.path.join(work, "again.jsonl"), "0", _mode(args)],
                             timeout=CHUNK_TIMEOUT_S)
                what = "hung" if rc == HUNG else f"died (exit {rc})"
                crashes.append({"kind": "crash", "seed": s, "program": crashed, "returncode": rc, "reproduces": rc2 != 0,
                                "error": f"child process {what} after {done} programs"})
            total = sum(len(_read_lines(f)) for f in results_files)
            print(f"chunk (seed {s}): {done} programs, exit {rc}, {total} total, {time.time() - t0:.0f} s", flush=True)
    return results_files, crashes


def _mode(args: argparse.Namespace) -> str:
    if args.loops:
        return "loops+search" if args.search else "loops"
    return ("pcg+search" if args.search else "pcg") if args.pcg else "search" if args.search else "plan"


def soak(args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="shardc-fuzz-")
    t0 = time.time()
    results_files, crashes = _run_chunks(args, work)
    recs = [r for f in results_files for r in _read_lines(f)]
    elapsed = time.time() - t0
    kinds = Counter(r["kind"] for r in recs)
    failures = [r for r in recs if r["kind"] != "ok"] + crashes
    # shrink and record every failure (upstream ones too: they are XLA's, but worth keeping); of programs
    # whose collectives differ from the plan's, the first few of each quantity (a wrong result matters more)
    shrink_dir = os.path.join(work, "shrunk.jsonl")
    recorded = []
    shrunk_per_quantity: Counter = Counter()
    for r in failures:
        quantity = (r.get("error") or "").split(":")[0]
        if r["kind"] == "collectives":
            shrunk_per_quantity[quantity] += 1
        if r["kind"] == "fail" or (r["kind"] == "collectives" and shrunk_per_quantity[quantity] <= SHRINK_PER_QUANTITY):
            _spawn(["--child-one", r["program"], shrink_dir, "1", _mode(args)], timeout=1800)
            last = (_read_lines(shrink_dir) or [{}])[-1]
            r = {**r, "shrunk": last.get("shrunk"), "pseudo": last.get("pseudo")}
        else:
            r = {**r, "pseudo": _describe(r["program"])}
        recorded.append(r)
    if recorded:
        with open(args.out, "a") as f:
            for r in recorded:
                f.write(json.dumps({**r, "found": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    errors = Counter(r.get("error") or r["kind"] for r in recorded)
    per_s = len(recs) / elapsed if elapsed else 0.0
    summary = [
        "| programs | seconds | programs/s | ok | of which float64-adjudicated | fail | upstream (XLA) | crash "
        "| right, collectives differ from plan | hinted dims checked | reshards | sharded values |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {len(recs)} | {elapsed:.0f} | {per_s:.1f} | {kinds['ok']} | {sum(bool(r.get('rounding')) for r in recs)} | "
        f"{kinds['fail']} | {kinds['upstream']} | {len(crashes)} | {kinds['collectives']} | {sum(r.get('hints', 0) for r in recs)} | "
        f"{sum(r.get('reshards', 0) for r in recs)} | {sum(r.get('sharded', 0) for r in recs)} / "
        f"{sum(r.get('values', 0) for r in recs)} |",
    ]
    if args.loops:
        summary.append(f"\n{sum(1 for r in recs if r.get('restructured'))} of the {len(recs)} programs had loops "
                       f"restructured ({sum(r.get('restructured', 0) for r in recs)} loops).")
    print("\n".join(summary))
    for e, n in errors.most_common():
        print(f"  {n} x {e}")
    if recorded:
        print(f"failures appended to {args.out}")
    if args.write:
        sys.path.insert(0, REPO)
        from bench.propagate import write_section

        lines = "\n".join(f"- {n} x {e}" for e, n in errors.most_common()) or "- none"
        write_section("fuzz", f"`python bench/fuzz.py --minutes {args.minutes} --seed {args.seed} --jobs {args.jobs} --max-ops "
                      f"{args.max_ops}{' --const-cotangents' if args.const_cotangents else ''}"
                      f"{' --pcg' if args.pcg else ''}{' --loops' if args.loops else ''}"
                      f"{' --search' if args.search else ''}` "
                      f"({os.cpu_count()} cores; each program checked sharded vs unsharded, forward and "
                      f"gradients, compiled shardings vs plan, hints, compiled collectives vs plan).\n\n" + "\n".join(summary)
                      + "\n\nFailures (shrunk programs in `bench/fuzz_failures.jsonl`):\n\n" + lines + "\n")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-chunk":
        s, n, m, c, mode, progress, results = sys.argv[2:9]
        child_chunk(int(s), int(n), int(m), bool(int(c)), mode, progress, results)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child-one":
        child_one(sys.argv[2], sys.argv[3], bool(int(sys.argv[4])), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="chunks run at once (one per core)")
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--max-ops", type=int, default=12)
    ap.add_argument("--const-cotangents", action="store_true",
                    help="close over the gradient's output cotangents as constants (XLA folds them)")
    ap.add_argument("--pcg", action="store_true",
                    help="check the substitution engine instead: random proved rewrites of each plan's PCG, run "
                         "through its shard_map lowering (tests/fuzz/pcg_check.py)")
    ap.add_argument("--search", action="store_true",
                    help="the plan checked (or made a PCG, with --pcg) is the strategy search's (search=True on the "
                         "program's mesh, a small budget), not its hints'")
    ap.add_argument("--loops", action="store_true",
                    help="programs with loops (more rnn/scan/fori draws), planned and run with their loops "
                         "restructured (shardc/loops.py), against the program as written")
    ap.add_argument("--out", default=os.path.join(HERE, "fuzz_failures.jsonl"))
    ap.add_argument("--write", action="store_true")
    soak(ap.parse_args())


if __name__ == "__main__":
    main()
