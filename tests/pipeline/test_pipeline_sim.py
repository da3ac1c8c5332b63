"""The simulator's pipeline view: the schedule's timeline against hand-computed ones, and a simulated
pipelined step's stage-boundary transfers on the topology level its stage axis maps to."""
import jax
import pytest

import shardc
from shardc.cost.topology import Topology
from shardc.pipeline import Pipeline
from shardc.pipeline.jit import for_mesh
from shardc.sim.pipeline import loop_regions, schedule_timeline

from test_pipeline_lowering import BATCH, D, make_args, make_step


def spans(tl, stage, phase):
    return [(s.microbatch, s.repeat, s.start, s.end) for s in tl.of_stage(stage) if s.phase == phase]


def test_gpipe_timeline_by_hand():
    # 2 stages, 4 microbatches: 5 iterations; forward piece 1 s, backward 2 s, shift 0.5 s
    tl = schedule_timeline(Pipeline(2, 4), 1.0, 2.0, 0.5)
    assert spans(tl, 0, "forward") == [(0, 0, 0.0, 1.0), (1, 0, 1.5, 2.5), (2, 0, 3.0, 4.0), (3, 0, 4.5, 5.5)]
    assert spans(tl, 1, "forward") == [(0, 0, 1.5, 2.5), (1, 0, 3.0, 4.0), (2, 0, 4.5, 5.5), (3, 0, 6.0, 7.0)]
    # the backward loop runs the iterations in reverse from 7.5 s, 2.5 s each: the last stage starts
    assert spans(tl, 1, "backward") == [(3, 0, 7.5, 9.5), (2, 0, 10.0, 12.0), (1, 0, 12.5, 14.5), (0, 0, 15.0, 17.0)]
    assert spans(tl, 0, "backward") == [(3, 0, 10.0, 12.0), (2, 0, 12.5, 14.5), (1, 0, 15.0, 17.0),
                                        (0, 0, 17.5, 19.5)]
    assert tl.makespan == 20.0 and tl.busy == 12.0
    assert tl.bubble == pytest.approx(0.4)
    # without transfer time the idle share is the schedule's bubble, (S - 1) / (M + S - 1)
    assert schedule_timeline(Pipeline(2, 4), 1.0, 2.0).bubble == pytest.approx(Pipeline(2, 4).bubble) == 0.2


def test_1f1b_and_circular_timelines_by_hand():
    tl = schedule_timeline(Pipeline(2, 4, "1f1b"), 1.0, 2.0)
    assert tl.makespan == 5 * 1.0 + 5 * 3.0  # each backward piece recomputes its forward
    assert spans(tl, 0, "backward")[0] == (3, 0, 8.0, 11.0)
    assert tl.bubble == pytest.approx(0.2)
    # circular, 2 stages x 2 repeats, 2 microbatches: each microbatch goes round twice, 5 iterations
    p = Pipeline(2, 2, "circular", repeats=2)
    tl = schedule_timeline(p, 1.0, 1.0)
    assert [(m, r) for m, r, _, _ in spans(tl, 0, "forward")] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [(m, r, a) for m, r, a, _ in spans(tl, 1, "forward")] == [(0, 0, 1.0), (1, 0, 2.0), (0, 1, 3.0),
                                                                      (1, 1, 4.0)]
    assert tl.bubble == pytest.approx(1 / 5) == p.bubble
    p8 = p.bind(8)
    assert p8.stage_layers() == ((0, 1, 4, 5), (2, 3, 6, 7))


TWO_LEVELS = {"name": "two-level", "device": {"peak_flops": {"float32": "100T"}, "mem_bandwidth": "1T",
                                              "memory": "16GiB"},
              "levels": [{"name": "node", "size": 4, "bandwidth": "100GB/s", "latency": "1us"},
                         {"name": "net", "size": 2, "bandwidth": "10GB/s", "latency": "10us"}]}


@pytest.mark.parametrize("order", [("stage", "data"), ("data", "stage")])
def test_stage_boundary_on_the_stage_axis_level(order):
    """The stage shifts are collective-permutes over the stage axis, priced on the level it maps to: across
    nodes (outer mesh axis) or inside one (inner)."""
    sizes = {"stage": 2, "data": 4}
    axes = {a: sizes[a] for a in order}
    mesh = shardc.make_mesh(axes)
    topo = Topology.from_dict(TWO_LEVELS)
    pipe = for_mesh(2, 4, axes, data=("data",))
    plan = shardc.plan(make_step(None), *make_args(), mesh=mesh, search=False, pipeline=pipe, topology=topo)
    assert plan.pipeline.layers == 8 and plan.pipeline.stages == 2
    cost = plan.cost.pipeline
    level = "net" if order[0] == "stage" else "node"  # the first mesh axis is the outer one
    bw, lat = (10e9, 10e-6) if level == "net" else (100e9, 1e-6)
    assert cost.boundary_levels == ((level, 2),)
    # 4 shifts per iteration (forward shift and buffer rotation, and their transposes), one microbatch's
    # rows of this device each: 32 / 4 microbatches / 4 data shards x 16 floats
    per_shift = BATCH // 4 // 4 * D * 4
    assert cost.boundary_bytes == 4 * pipe.iterations * per_shift
    assert cost.boundary_s == pytest.approx(4 * pipe.iterations * (per_shift / bw + lat), rel=1e-6)
    # both loops (forward and its transpose) are found, and most of the step's compute is in them
    assert len({r.split("/")[1] for r in loop_regions(plan.graph)}) == 2
    assert 0.5 * plan.cost.compute_time < cost.loop_compute_s < plan.cost.compute_time
    assert cost.bubble_s == pytest.approx(cost.loop_compute_s * 0.2)
    assert cost.stage_peak_memory == (plan.cost.peak_memory,) * 2
    assert "stage boundary" in str(plan.cost)


def test_pipeline_option_errors():
    step, args = make_step(None), make_args()
    with pytest.raises(shardc.ShardingError, match="needs mesh="):
        shardc.plan(step, *args, pipeline=Pipeline(2, 4))
    with pytest.raises(shardc.ShardingError, match="expected a shardc.pipeline.Pipeline"):
        shardc.plan(step, *args, mesh=shardc.make_mesh({"stage": 2, "data": 4}), pipeline=(2, 4))
    with pytest.raises(shardc.ShardingError, match="no layer stack"):
        shardc.plan(lambda p, s, x, y: x @ p["embed"], *args, mesh=shardc.make_mesh({"stage": 2, "data": 4}),
                    pipeline=Pipeline(2, 4), search=False)


def test_explain_shows_the_stage_map():
    axes = {"stage": 2, "data": 4}
    plan = shardc.plan(make_step(None), *make_args(), mesh=shardc.make_mesh(axes), search=False,
                       pipeline=for_mesh(2, 4, axes, "1f1b", data=("data",)), topology="h100-sxm-8")
    text = plan.explain()
    assert "pipeline: 1f1b, 2 stages over mesh axis 'stage', 4 microbatches" in text
    assert "stage 0 (stage=0): layers 0-3 of scan 0" in text
    assert "stage 1 (stage=1): layers 4-7 of scan 0" in text
    assert "stage boundary" in text  # the simulated cost's pipeline view


def test_1f1b_stage_memory_below_gpipe():
    """With activations dominating (a batch of 1024 rows), 1F1B's stages keep only their inputs: the simulated
    per-stage peak drops well below gpipe's, and XLA's compiled temporaries drop with it."""
    from test_pipeline_lowering import LAYERS, TX

    axes = {"stage": 2, "data": 4}
    mesh = shardc.make_mesh(axes)
    k = jax.random.split(jax.random.key(0), 7)
    p = {"embed": jax.random.normal(k[0], (D, D)), "head": jax.random.normal(k[1], (D, 4)),
         "layers": {"w1": jax.random.normal(k[2], (LAYERS, D, 2 * D)),
                    "w2": jax.random.normal(k[3], (LAYERS, 2 * D, D)), "b": jax.random.normal(k[4], (LAYERS, D))}}
    args = (p, TX.init(p), jax.random.normal(k[5], (1024, D)), jax.random.normal(k[6], (1024, 4)))
    sim, xla = {}, {}
    for schedule in ("gpipe", "1f1b"):
        f = shardc.auto(make_step(None), mesh=mesh, search=False, topology="h100-sxm-8",
                        pipeline=for_mesh(2, 8, axes, schedule, data=("data",)))
        cost = f.plan(*args).cost
        assert cost.pipeline.stage_peak_memory == (cost.peak_memory,) * 2
        sim[schedule] = cost.peak_memory
        xla[schedule] = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert sim["1f1b"] < 0.7 * sim["gpipe"], sim
    assert xla["1f1b"] < 0.7 * xla["gpipe"], xla
