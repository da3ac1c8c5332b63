"""Baselines inside the stages of a pipelined program: the stacked per-layer state's layer dim over the stage
axis, every baseline's own layout on the other axes, and megatron-3d (Megatron-LM's 3-D parallelism) in
place of megatron."""
import shardc
from shardc.pipeline import Pipeline
from shardc.search.baselines import baseline_seeds, data_inputs, stacked_state, state_inputs

from test_pipeline_lowering import LAYERS, make_args, make_step

MESH = {"stage": 2, "data": 2, "model": 2}


def _plan():
    pipe = Pipeline(2, 4, data=("data",), shards=2)
    return shardc.plan_for(make_step(None), *make_args(), topology="h100-sxm-8", pipeline=pipe, budget_s=0.5)


def test_megatron_3d_seeds_stages_tensor_and_data_parallel():
    plan = _plan()
    g, pipe = plan.graph, plan.pipeline
    assert pipe.layers == LAYERS
    seeds = {s.value: s.dims for s in baseline_seeds("megatron-3d", g, MESH, (), pipe)}
    stacked = stacked_state(g, LAYERS)
    names = {v: g.values[v].name for v in stacked}
    assert sum("w1" in n for n in names.values()) == 3  # the parameter and Adam's two moments
    for v in stacked:
        dims, name = seeds[v], names[v]
        assert dims[0] == ("stage",), (name, dims)
        if "w1" in name:  # (D, 2D): column-parallel
            assert dims[1:] == ((), ("model",)), (name, dims)
        elif "w2" in name:  # (2D, D): row-parallel
            assert dims[1:] == (("model",), ()), (name, dims)
        else:  # the bias: replicated inside the stage
            assert dims[1:] == ((),), (name, dims)
    for v in set(state_inputs(g)) - set(stacked):  # embedding and head: not on the stage axis
        assert all("stage" not in ax for ax in seeds.get(v, ())), g.values[v].name  # (a scalar: no seed)
    for v in data_inputs(g):  # the batch over the data axis, not the stage axis nor the model axis
        assert seeds[v][0] == ("data",)
    assert baseline_seeds("megatron", g, MESH, (), pipe) is None  # megatron-3d stands in for it
    assert baseline_seeds("megatron-3d", g, MESH) is None  # no pipeline: no megatron-3d


def test_every_baseline_keeps_the_stage_axis_for_the_layer_dim():
    plan = _plan()
    g, pipe = plan.graph, plan.pipeline
    stacked = set(stacked_state(g, LAYERS))
    for name in ("data-parallel", "fsdp"):
        seeds = baseline_seeds(name, g, MESH, (), pipe)
        for s in seeds:
            on_stage = [d for d, ax in enumerate(s.dims) if ax and "stage" in ax]
            assert on_stage == ([0] if s.value in stacked else []), (name, g.values[s.value].name, s.dims)
            if s.value in stacked:
                assert s.dims[0][0] == "stage"
    fsdp = {s.value: s.dims for s in baseline_seeds("fsdp", g, MESH, (), pipe)}
    w1 = next(v for v in stacked if "w1" in g.values[v].name)
    assert fsdp[w1][2] == ("data", "model")  # ZeRO-3 inside the stage, on the largest dim
    report = plan.search
    assert {"megatron-3d", "fsdp"} <= {c.name for c in report.baselines}
    assert "megatron" not in {c.name for c in report.baselines}
