"""Which candidate pipelines a choice need not screen: those bounded by a faster sibling.

Siblings are pipelines that differ only in how the weight gradients are made: deferred past the loop
(`defer_wgrad`), accumulated in the loop, or accumulated with 1F1B's recomputation (`candidates` lists them
in that order). For one baseline's layout, the accumulating program does the work of the deferring one
plus the loop's accumulation of every iteration's weight gradients (bubble iterations included) instead
of one GEMM per weight after the loop, and 1F1B adds a second forward pass to that. So, layout for layout,
neither is faster than its sibling with deferred weight gradients; what they can do is fit memory where
that one does not (docs/pipeline.md: near the memory limit the slower siblings' layouts fit).

A baselines-only screen (`search="baselines"`) scores each candidate by its fastest baseline plan that
fits. When the *fastest* baseline plan of a screened pipeline with deferred weight gradients fits anyway,
no baseline plan of its accumulating or 1F1B sibling can be faster: their screens are not below this
one's. They can then matter only if this pipeline is among the finalists (they might be too), and
`choose_pipeline` screens them exactly then.

The premise is the cost model's, not a theorem. In the screens of docs/pipeline.md's gpt12-wide runs
(h100-sxm-8x8 and -8x32, every candidate screened) it held for every pair with a margin of 15 ms or more,
while 1F1B against gpipe *without* deferral did not (1F1B was up to 5 ms faster in 4 of 31 pairs): so the
bound is the deferred sibling, for both. tests/pipeline/test_pipeline_choose.py checks that the choice is
the one screening every candidate makes; `choose_pipeline(bound_siblings=False)` screens them all.
"""
from __future__ import annotations

from typing import Any, Sequence

from shardc.pipeline.value import Pipeline

__all__ = ["bounding_sibling", "fastest_baseline_fits"]


def bounding_sibling(p: Pipeline) -> Pipeline | None:
    """The sibling with deferred weight gradients, whose layouts are as fast as `p`'s or faster: gpipe's for
    gpipe and 1f1b, circular's for circular; None for a pipeline that defers them itself."""
    if p.defer_wgrad:
        return None
    schedule = "gpipe" if p.schedule == "1f1b" else p.schedule
    return Pipeline(p.stages, p.microbatches, schedule, p.repeats, p.axis, p.data, p.shards, p.layers, p.stack,
                    defer_wgrad=True)


def fastest_baseline_fits(plan: Any) -> bool:
    """Whether the fastest plan a baselines-only screen scored — memory aside — fits (its screen is then the
    fastest any of its baseline layouts can be). False when the plan has no search report."""
    report = getattr(plan, "search", None)
    scored: Sequence[Any] = getattr(report, "baselines", None) or ()
    if not scored or getattr(report, "method", None) != "baselines only":
        return False
    fastest = min(scored, key=lambda c: (c.score.time, not c.score.feasible))
    return bool(fastest.score.feasible)
