"""The translation example end to end on the synthetic task (tiny model, a few steps), and bit-for-bit resume."""
import json

import jax
import numpy as np
import pytest

from moe import translate

COMMON = [
    "--corpus", "synthetic", "--synthetic-size", "1500", "--model", "tiny", "--vocab-size", "400",
    "--max-len", "24", "--buckets", "24", "--batch-tokens", "768", "--steps", "6", "--warmup", "2",
    "--time-limit", "0", "--quiet", "--no-plot", "--mesh", "data=2,expert=4",
]


@pytest.fixture
def compilation_cache(tmp_path):
    """A persistent compilation cache for this test only: the three runs compile the same programs."""
    try:
        from jax._src import compilation_cache as cc
    except ImportError:  # pragma: no cover
        yield
        return
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    old = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.reset_cache()
    try:
        yield
    finally:
        for n, v in old.items():
            jax.config.update(n, v)
        cc.reset_cache()


def test_example_runs_end_to_end_and_resume_is_bit_for_bit(tmp_path, compilation_cache):
    # Uninterrupted run, with the final evaluation (BLEU vs the copy baseline, samples, plot).
    full = translate.main(COMMON + ["--out", str(tmp_path / "full"), "--ckpt-every", "0",
                                    "--eval-sentences", "16", "--samples", "1"])
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["test_pairs"] == 16
    assert np.isfinite(summary["bleu"]) and np.isfinite(summary["copy_bleu"])
    assert (tmp_path / "full" / "translations.tsv").exists()
    losses = [h["loss"] for h in full["history"]]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert losses[-1] < losses[0]

    # Killed after step 3 (checkpoint every 3 steps), then resumed.
    out = str(tmp_path / "resumed")
    first = translate.main(COMMON + ["--out", out, "--ckpt-every", "3", "--stop-at", "3"])
    assert first["step"] == 3
    second = translate.main(COMMON + ["--out", out, "--ckpt-every", "3", "--resume", "--no-final-eval"])
    assert second["step"] == 6
    resumed = [h["loss"] for h in second["history"]]
    # The resumed run's history holds steps 1-3 (from the checkpoint) and 4-6 (recomputed): all equal
    # to the uninterrupted run, bit for bit.
    assert resumed == losses

    # Run again over that run's checkpoints without --resume: a fresh run (its checkpoint at step 3 used to
    # clash with the earlier run's: orbax StepAlreadyExistsError).
    again = translate.main(COMMON + ["--out", out, "--ckpt-every", "3", "--no-final-eval"])
    assert [h["loss"] for h in again["history"]] == losses


def test_search_flag_lets_the_strategy_search_plan_the_step(tmp_path, capsys):
    out = tmp_path / "searched"
    result = translate.main(COMMON[:COMMON.index("--steps")] + ["--steps", "2", "--warmup", "1", "--time-limit", "0",
                            "--quiet", "--no-plot", "--mesh", "data=2,expert=4", "--out", str(out),
                            "--ckpt-every", "0", "--no-final-eval", "--search"])
    assert result["step"] == 2 and all(np.isfinite(h["loss"]) for h in result["history"])
    plan_text = (out / "plan.txt").read_text()
    assert "strategy search" in plan_text  # the plan came from the search, not from propagation alone
