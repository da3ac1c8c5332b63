"""Zoo models at smoke-test size (bench/zoo_models.py, `tiny`): the searched plan's PCG rewritten by the engine
(chosen or not) runs as `shardc.auto(pcg=True)` runs a chosen one (`jit_pcg`) on the 8 CPU devices and equals
`jax.jit(step)`, with the collectives it names (issue 18; every model: `python -m bench.pcg_zoo --check`)."""
import jax
import pytest

import shardc
from bench.pcg_zoo import TOPOLOGY, check_numerics, concrete
from bench.zoo_models import zoo
from shardc.pcg.choice import choose_pcg


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt12"])
def test_rewritten_zoo_pcg_equals_jit(name):
    zm = next(m for m in zoo("tiny") if m.name == name)
    mesh = shardc.make_mesh({"data": 2, "model": 2, "expert": 2}, jax.devices()[:8])
    step, args = zm.build(mesh)
    c = shardc.auto(step, search=True, topology=TOPOLOGY, budget_s=2, devices=8).compiled_info(*args)
    ch = choose_pcg(c.plan, c.closed_jaxpr, TOPOLOGY, max_evaluations=15)
    assert ch.steps, "no rewrite kept: nothing of the engine's is tested"
    worst, differ = check_numerics(step, concrete(args), c.plan, ch.pcg)
    assert worst < 1e-4 and not differ, (worst, differ)
