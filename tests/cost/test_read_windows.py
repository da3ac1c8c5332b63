"""`read_windows` / `window_unread`: a slice XLA's simplifier moves through data-movement ops down to a
concatenate (or a pad) reads only the operands its window covers; what only the others need is dead. Each case
is checked against what XLA compiles (whether `sin(b)` survives) and against the static model (whether the sine
op is live)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import shardc
from shardc.cost.program import liveness
from shardc.cost.windows import read_windows


def _cat(a, b):
    return jnp.concatenate([a, jnp.sin(b)])


CASES = {  # name: (function of a[4], b[3], whether XLA reads b)
    "slice of a concatenate": (lambda a, b: _cat(a, b)[1:3], False),
    "dynamic slice at a literal start": (lambda a, b: lax.dynamic_slice(_cat(a, b), (1,), (2,)), False),
    "dynamic slice at a computed constant start": (lambda a, b: lax.dynamic_slice(_cat(a, b), (jnp.array(-6),), (2,)),
                                                   False),
    "dynamic slice at a computed constant start in b": (
        lambda a, b: lax.dynamic_slice(_cat(a, b), (jnp.array(-2),), (2,)), True),
    "dynamic slice clamped into b": (lambda a, b: lax.dynamic_slice(_cat(a, b), (6,), (2,)), True),
    "slice across both operands": (lambda a, b: _cat(a, b)[3:5], True),
    "slice of a broadcast": (lambda a, b: jnp.broadcast_to(_cat(a, b), (2, 7))[:, 1:3], False),
    "two slices of a broadcast": (lambda a, b: (lambda y: (y[:, 1:3], y[:1, 0:2]))(
        jnp.broadcast_to(_cat(a, b), (2, 7))), False),
    "slice of a slice": (lambda a, b: _cat(a, b)[0:5][1:3], False),
    "slice of a reverse": (lambda a, b: _cat(a, b)[::-1][4:6], False),
    "slice of a pad": (lambda a, b: jnp.pad(_cat(a, b), (2, 0))[3:5], False),
    "slice of the padding of b": (lambda a, b: jnp.concatenate([a, jnp.pad(jnp.sin(b), (1, 0))])[4:5], False),
    "split": (lambda a, b: jnp.split(_cat(a, b), [2])[0], False),
    "strided slice": (lambda a, b: _cat(a, b)[0:4:2], False),
    "strided slice reaching b": (lambda a, b: _cat(a, b)[1:6:4], True),
    "slice of an elementwise op": (lambda a, b: (-_cat(a, b))[1:3], True),
    "slice of a reshape": (lambda a, b: _cat(a, b).reshape(1, 7)[:, 1:3], True),
    "slice of a convert": (lambda a, b: _cat(a, b).astype(jnp.float16)[1:3], True),
    "slice and the whole": (lambda a, b: (_cat(a, b)[1:3], _cat(a, b)), True),
    "gather at one constant index": (lambda a, b: jnp.take(_cat(a, b), np.array([2])), False),
    "gather at one constant index in b": (lambda a, b: jnp.take(_cat(a, b), np.array([5])), True),
    "gather at a negative constant index": (lambda a, b: jnp.take(_cat(a, b), np.array([[-5]])), False),
    "gather at a scalar index": (lambda a, b: jnp.take(_cat(a, b), 1), False),
    "gather at two constant indices": (lambda a, b: jnp.take(_cat(a, b), np.array([1, 2])), True),
    "gather clipped into b": (lambda a, b: jnp.take(_cat(a, b), np.array([9]), mode="clip"), True),
    "gather out of bounds": (lambda a, b: jnp.take(_cat(a, b), np.array([9]), mode="fill"), False),
    "gather at a computed index": (lambda a, b: jnp.take(_cat(a, b), a.astype(int)[:1]), True),
}
ARGS = (jnp.arange(4.0), jnp.arange(3.0))


def _xla_reads_b(f) -> bool:
    return "sine" in jax.jit(f).lower(*ARGS).compile().as_text()


@pytest.mark.parametrize("name", list(CASES))
def test_the_model_agrees_with_what_xla_reads(name):
    f, reads = CASES[name]
    assert _xla_reads_b(f) is reads  # (what XLA does, so the table above is right)
    graph = shardc.auto(f, mesh=shardc.make_mesh({"x": 8}), search=False).plan(*ARGS).graph
    live = liveness(graph)
    assert any(live[op.id] for op in graph.ops if op.primitive == "sin") is reads


def test_windows_are_boxes_per_dim():
    f = lambda a, b: jnp.broadcast_to(_cat(a, b), (2, 7))[:1, 1:3]  # noqa: E731
    graph = shardc.auto(f, mesh=shardc.make_mesh({"x": 8}), search=False).plan(*ARGS).graph
    cat = next(op for op in graph.ops if op.primitive == "concatenate")
    boxes = read_windows(graph)
    assert boxes[cat.outputs[0]] == ((1, 3),)
    assert [boxes[v] for v in cat.inputs] == [((1, 3),), None]


def test_a_gathers_constant_index_is_folded_as_xla_folds_it():
    """`jnp.take` wraps a negative index with lt/add/select_n over the constant: the index the gather reads is
    the folded one (-5 of 7 elements: 2), and an index computed from an input is no constant."""
    from shardc.ir.folding import constant_array
    f = lambda a, b: (jnp.take(_cat(a, b), np.array([[-5]])), jnp.take(_cat(a, b), a.astype(int)[:1]))  # noqa: E731
    graph = shardc.auto(f, mesh=shardc.make_mesh({"x": 8}), search=False).plan(*ARGS).graph
    folded, computed = [constant_array(graph, op.inputs[1]) for op in graph.ops if op.primitive == "gather"]
    assert folded is not None and folded.reshape(-1).tolist() == [2]
    assert computed is None
