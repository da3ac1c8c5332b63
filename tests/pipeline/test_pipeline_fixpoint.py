"""The pipeline loop linearized from its known fixpoint (shardc/pipeline/fixpoint.py) traces the very program
JAX's own fixpoint traces — for every schedule, with and without data shards and deferred weight gradients,
and when the fixpoint is not known (a loop whose activations enter without a tangent) — in fewer passes."""
import jax
import jax.numpy as jnp
import pytest

import annotations as A
import shardc
import shardc.pipeline.fixpoint as fixpoint
from shardc.pipeline import Pipeline
from shardc.pipeline.stacks import find_stacks, largest, pipelining
from tests.pipeline.test_pipeline_lowering import make_args, make_step

MESH = {"stage": 2, "data": 2, "model": 2}
PIPELINES = [Pipeline(2, 4, "gpipe"), Pipeline(2, 4, "gpipe", data=("data",), shards=2, defer_wgrad=True),
             Pipeline(2, 2, "1f1b", data=("data",), shards=2), Pipeline(2, 2, "circular", repeats=2),
             Pipeline(2, 2, "circular", repeats=2, defer_wgrad=True)]


def _layers_only_step():
    """A step differentiating the layers' parameters alone: the activations enter the loop without a
    tangent (the fixpoint is not known there; JAX's runs)."""

    def step(p, s, x, y):
        def loss_fn(layers):
            h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w["w1"]) @ w["w2"] + w["b"], None),
                                jnp.tanh(x @ p["embed"]), layers)
            return jnp.mean((h @ p["head"] - y) ** 2)

        return jax.value_and_grad(loss_fn)(p["layers"])

    return step


def _trace(step, args, pipe: Pipeline, known: bool, monkeypatch) -> tuple[str, int]:
    """The pipelined step's jaxpr (text) and how many times JAX linearized a jaxpr while tracing it."""
    calls = [0]
    real = fixpoint._LINEARIZE

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(fixpoint, "_LINEARIZE", counting)
    monkeypatch.setattr(fixpoint._ad, "linearize_jaxpr", counting)
    monkeypatch.setattr(fixpoint, "_SCAN", fixpoint._loops.scan_p if known else None)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(args)]
    tree = jax.tree.structure(args)
    f = lambda *a: step(*jax.tree.unflatten(tree, a))  # noqa: E731
    mesh = shardc.make_mesh(MESH)
    with A.mesh_context(mesh), A.provisional_mesh(True), jax.set_mesh(mesh):
        with find_stacks() as seen:
            jax.make_jaxpr(lambda *a: f(*a))(*abstract)
        calls[0] = 0
        with pipelining(pipe, largest(seen).index):
            closed = jax.make_jaxpr(lambda *a: f(*a))(*abstract)
    return str(closed), calls[0]


@pytest.mark.parametrize("pipe", PIPELINES, ids=lambda p: p.describe()[:40])
def test_known_fixpoint_traces_the_same_program_in_fewer_passes(pipe, monkeypatch):
    step, args = make_step(None), make_args()
    program, passes = _trace(step, args, pipe, False, monkeypatch)
    faster, fewer = _trace(step, args, pipe, True, monkeypatch)
    assert faster == program
    assert fewer < passes


def test_an_unknown_fixpoint_is_left_to_jax(monkeypatch):
    step, args, pipe = _layers_only_step(), make_args(), Pipeline(2, 4, "gpipe")
    program, passes = _trace(step, args, pipe, False, monkeypatch)
    same, count = _trace(step, args, pipe, True, monkeypatch)
    assert same == program and count == passes


def test_the_rule_is_restored():
    rule = fixpoint._RULES[fixpoint._SCAN]
    with fixpoint.known_fixpoint(1):
        assert fixpoint._RULES[fixpoint._SCAN] is not rule
    assert fixpoint._RULES[fixpoint._SCAN] is rule
    x = jnp.ones(3)
    jax.grad(lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=2)[0].sum())(x)
    assert fixpoint._RULES[fixpoint._SCAN] is rule
