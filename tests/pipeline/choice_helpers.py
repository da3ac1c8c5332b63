"""Helpers of the pipeline-choice tests."""
import importlib

from shardc.search.driver import NoPlanFits


def no_unpipelined_plan_fits(monkeypatch):
    """`shardc.plan_for` raises NoPlanFits for the unpipelined step (so a pipeline must be chosen); pipelined
    steps plan as usual. Returns the real `plan_for`."""
    auto = importlib.import_module("shardc.auto")  # (the module: shardc.auto is the decorator)
    real = auto.plan_for

    def unpipelined_unfit(step, *args, pipeline=None, **options):
        if pipeline is None:
            raise NoPlanFits(2**40, 2**30)
        return real(step, *args, pipeline=pipeline, **options)

    monkeypatch.setattr(auto, "plan_for", unpipelined_unfit)
    return real
