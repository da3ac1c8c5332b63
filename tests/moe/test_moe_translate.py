"""The translation example end to end on the synthetic task (tiny model, a few steps): the strategy search's
report, bit-for-bit resume after --stop-at, after SIGTERM and after Ctrl-C (in subprocesses, resumed with
the command the run printed), the opt-in time limit, and --help."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe import translate

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--corpus", "synthetic", "--synthetic-size", "1500", "--model", "tiny", "--vocab-size", "400",
    "--max-len", "24", "--buckets", "24", "--batch-tokens", "768", "--warmup", "2",
    "--quiet", "--no-plot", "--mesh", "data=2,expert=4",
    "--dropout", "0.1",  # not the default: bit-for-bit resume must hold with the dropout RNG drawing too
]
# two sequence buckets: two batch shapes, so two programs planned (and kept in OUT/plan.json) in one run; a
# small search budget (the report still lists every baseline: they are scored before the search proper)
COMMON = TINY + ["--buckets", "8,24", "--steps", "6", "--search-budget", "1"]
@pytest.fixture
def compilation_cache(jax_persistent_cache):
    """A persistent compilation cache for this test only (its runs, and its subprocesses', compile the same
    programs; `jax_persistent_cache` in tests/conftest.py); yields the environment that gives a subprocess the
    same cache."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(jax_persistent_cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    yield env


def test_example_runs_end_to_end_with_the_search_and_resume_is_bit_for_bit(tmp_path, compilation_cache, capsys):
    # Stopped after step 3 (checkpoint every 3 steps), then resumed with the command it printed.
    out = tmp_path / "run"
    first = translate.main(COMMON + ["--out", str(out), "--ckpt-every", "3", "--stop-at", "3"])
    assert first["step"] == 3
    printed = capsys.readouterr().out
    command = printed_resume_command(printed)
    assert "--stop-at" not in command and command[-1] == "--resume"
    # By default the strategy search plans the step and the run prints its report: the chosen plan
    # against every baseline, priced on the devices at hand; the plan is kept for --resume.
    report = printed[printed.index("strategy search"):]
    for baseline in ("hints", "data-parallel", "fsdp", "megatron", "expert-parallel"):
        assert re.search(rf"^  {baseline} +mesh\(data=2,expert=4\)", report, re.M), baseline
    assert "chosen:" in report and "priced on cpu-host" in printed
    assert "strategy search" in (out / "plan.txt").read_text()
    saved = json.loads((out / "plan.json").read_text())["plans"]  # one plan per batch shape planned so far
    assert saved and all(p["mesh"] == {"data": 2, "expert": 4} for p in saved.values())
    second = translate.main(command[3:] + ["--no-final-eval"])
    assert second["step"] == 6
    printed = capsys.readouterr().out
    assert "strategy search" not in printed and "loaded from" in printed  # the saved plan, not a new search
    assert len(json.loads((out / "plan.json").read_text())["plans"]) == 2  # both buckets' programs by step 6

    # Run again over those checkpoints without --resume: a fresh, uninterrupted run (its checkpoint at step 3
    # used to clash with the earlier run's: orbax StepAlreadyExistsError), which searches again, with the final
    # evaluation (BLEU vs the copy baseline, samples, plot).
    full = translate.main(COMMON + ["--out", str(out), "--ckpt-every", "3", "--eval-sentences", "16",
                                    "--samples", "1"])
    assert "strategy search" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["test_pairs"] == 16 and summary["search"] is True
    assert np.isfinite(summary["bleu"]) and np.isfinite(summary["copy_bleu"])
    assert (out / "translations.tsv").exists()
    losses = [h["loss"] for h in full["history"]]
    assert len(losses) == 6 and all(np.isfinite(losses)) and full["exit_code"] == 0
    assert losses[-1] < losses[0]
    # The resumed run's history holds steps 1-3 (from the checkpoint) and 4-6 (recomputed): all equal
    # to the uninterrupted run, bit for bit.
    assert [h["loss"] for h in second["history"]] == losses


def printed_resume_command(text: str) -> list[str]:
    """The command a stopped run printed on the line after 'Continue with' / 'continue with'."""
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if line.rstrip().lower().endswith("continue with")]
    assert at, f"no resume command in:\n{text}"
    command = shlex.split(lines[at[-1] + 1])
    assert command[:3] == ["python", "-m", "moe.translate"]
    return command


def _run_until_step(command: list[str], env: dict, step: int, sig: signal.Signals) -> tuple[int, str]:
    """Run `python -m moe.translate ...` in a subprocess, send `sig` once it printed step `step`; return its
    exit code and output."""
    proc = subprocess.Popen([sys.executable] + command[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"step {step} "):
                proc.send_signal(sig)
        return proc.wait(timeout=300), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT)])
def test_sigterm_and_ctrl_c_checkpoint_and_the_printed_command_resumes_bit_for_bit(tmp_path, compilation_cache,
                                                                                   first, second):
    out = str(tmp_path / "run")
    # Many steps and no periodic checkpoint: only the signal's checkpoint keeps the progress. (--no-search to
    # save time: the searched plan's resume is checked above.)
    start = ["python", "-m", "moe.translate"] + TINY + ["--steps", "100000", "--log-every", "1", "--no-search",
                                                          "--ckpt-every", "0", "--no-final-eval", "--out", out]
    code, text = _run_until_step(start, compilation_cache, 3, first)
    stopped = re.search(rf"\*\*\* {first.name}: stopped training at step (\d+) of 100000", text)
    assert code == 128 + first and stopped and "Traceback" not in text, text
    k1 = int(stopped.group(1))
    assert k1 >= 3

    command = printed_resume_command(text)
    assert command == start + ["--resume"]
    code, text = _run_until_step(command, compilation_cache, k1 + 3, second)
    stopped = re.search(rf"\*\*\* {second.name}: stopped training at step (\d+) of 100000", text)
    assert code == 128 + second and stopped and f"resume  from step {k1}" in text and "Traceback" not in text, text
    k2 = int(stopped.group(1))
    assert k2 >= k1 + 3
    assert printed_resume_command(text) == command

    # The same run without interruptions, stopped at the same step: the same losses, bit for bit.
    ref = translate.main(start[3:] + ["--stop-at", str(k2), "--out", str(tmp_path / "ref")])
    interrupted = json.loads((Path(out) / "history.json").read_text())
    assert len(interrupted) == k2 and [h["loss"] for h in interrupted] == [h["loss"] for h in ref["history"]]


def test_time_limit_is_opt_in_and_says_how_to_continue(tmp_path, capsys):
    defaults = translate.build_args([])
    assert defaults.time_limit == 0 and defaults.search is True and defaults.stop_at is None
    out = str(tmp_path / "limited")
    result = translate.main(TINY + ["--steps", "50", "--time-limit", "1e-6", "--ckpt-every", "0",
                                    "--no-final-eval", "--no-search", "--out", out])
    printed = capsys.readouterr().out
    assert result["step"] == 0 and result["exit_code"] == 0
    assert "--time-limit 1e-06 min reached: stopped training at step 0 of 50" in printed
    assert "hints plus propagation" in printed and "strategy search" not in (Path(out) / "plan.txt").read_text()
    assert printed_resume_command(printed)[-3:] == ["--out", out, "--resume"]


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        translate.build_args(["--help"])
    text = capsys.readouterr().out
    options = vars(translate.build_args([]))
    for name in options:
        assert f"--{name.replace('_', '-')}" in text, name
    assert text.count("(default:") == len(options)


def test_resume_command_drops_stop_at_and_keeps_every_other_flag():
    assert translate.resume_command(["--steps", "9", "--stop-at", "3", "--out", "a b", "--resume"]) == \
        "python -m moe.translate --steps 9 --out 'a b' --resume"
    assert translate.resume_command(["--stop-at=3", "--quiet"]) == "python -m moe.translate --quiet --resume"
