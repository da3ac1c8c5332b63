"""`reads_only_padding`: a slice (or a dynamic slice at literal starts, or the negative pad that transposes a
slice) of nothing but a pad's padding is a constant to XLA's simplifier, which then reads nothing of the padded
value; checked against what XLA compiles for each window."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import shardc
from shardc.cost.program import reads_only_padding

CASES = {  # name: (function of x[4], whether XLA folds the read)
    "before the first element": (lambda x: lax.pad(x, 0.0, [(3, 0, 0)])[0:2], True),
    "after the last element": (lambda x: lax.pad(x, 0.0, [(0, 3, 0)])[5:7], True),
    "overlapping the value": (lambda x: lax.pad(x, 0.0, [(0, 3, 0)])[3:5], False),
    "after the last, interior padding": (lambda x: lax.pad(x[:1], 0.0, [(0, 2, 1)])[1:2], True),
    "between two elements": (lambda x: lax.pad(x, 0.0, [(0, 0, 2)])[1:3], False),
    "dynamic slice after the last": (lambda x: lax.dynamic_slice(lax.pad(x, 0.0, [(0, 3, 0)]), (5,), (2,)), True),
    "dynamic slice clamped onto the value": (lambda x: lax.dynamic_slice(lax.pad(x, 0.0, [(0, 1, 0)]), (9,), (2,)),
                                             False),
    # (a sort along a dim of size 1 is its operand to the simplifier, which then folds the slice of the pad)
    "through a sort along a dim of one": (lambda x: lax.slice(
        lax.sort(lax.pad(x.reshape(1, 4), 0.0, [(0, 0, 0), (3, 0, 0)]), dimension=0), (0, 0), (1, 2)), True),
    "through a sort along the padded dim": (lambda x: lax.slice(
        lax.sort(lax.pad(x.reshape(1, 4), 0.0, [(0, 0, 0), (3, 0, 0)]), dimension=1), (0, 0), (1, 2)), False),
}


def _xla_reads_x(f) -> bool:
    text = jax.jit(f).lower(jnp.arange(4.0)).compile().as_text()
    entry = text[text.index("ENTRY"):]
    return any("%x" in line.split("=", 1)[1] for line in entry.splitlines()[1:] if "=" in line)


@pytest.mark.parametrize("name", list(CASES))
def test_the_rule_agrees_with_what_xla_folds(name):
    f, folded = CASES[name]
    assert _xla_reads_x(f) is not folded  # (what XLA does, so the table above is right)
    graph = shardc.auto(f, mesh=shardc.make_mesh({"x": 8}), search=False).plan(jnp.arange(4.0)).graph
    last = [op for op in graph.ops if op.primitive in ("slice", "dynamic_slice")][-1]
    assert reads_only_padding(graph, last) is folded
