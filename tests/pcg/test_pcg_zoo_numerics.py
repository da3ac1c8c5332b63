"""Zoo models at smoke-test size (bench/zoo_models.py, `tiny`): the searched plan's PCG rewritten by the engine
(chosen or not) runs as `shardc.auto(pcg=True)` runs a chosen one (`jit_pcg`) on the 8 CPU devices and equals
`jax.jit(step)`, with the collectives it names (the LSTM's with partial-sum loop carries; issue 18; every model:
`python -m bench.pcg_zoo --check`)."""
import jax
import pytest

import shardc
from bench.pcg_zoo import TOPOLOGY, check_numerics, concrete
from bench.zoo_models import zoo
from shardc.pcg.choice import choose_pcg


def _rewritten_equals_jit(name: str) -> list[str]:
    """The rules of the rewrites kept on the tiny zoo model `name`, after checking its rewritten PCG."""
    zm = next(m for m in zoo("tiny") if m.name == name)
    mesh = shardc.make_mesh({"data": 2, "model": 2, "expert": 2}, jax.devices()[:8])
    step, args = zm.build(mesh)
    c = shardc.auto(step, search=True, topology=TOPOLOGY, budget_s=2, devices=8).compiled_info(*args)
    ch = choose_pcg(c.plan, c.closed_jaxpr, TOPOLOGY, max_evaluations=15)
    assert ch.steps, "no rewrite kept: nothing of the engine's is tested"
    worst, differ = check_numerics(step, concrete(args), c.plan, ch.pcg)
    assert worst < 1e-4 and not differ, (worst, differ)
    return [s.rule for s in ch.steps]


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt12"])
def test_rewritten_zoo_pcg_equals_jit(name):
    _rewritten_equals_jit(name)


def test_the_zoo_lstm_with_partial_sum_carries_equals_jit():
    assert "partial_sum_carry" in _rewritten_equals_jit("lstm")  # (its backward loops' gradient accumulators)
