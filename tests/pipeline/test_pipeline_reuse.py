"""What the candidates of a pipeline choice share (shardc/pipeline/reuse.py): the layer stack `choose_pipeline`
finds before enumerating them (`stack_of`) is the one each candidate's own trace would find, so their traces
start from it instead of tracing the unpipelined step once more."""
import jax
import pytest

from annotations import provisional_mesh
from bench.gpt import make_train_step, setup
from bench.zoo_models import _unbox
from shardc.auto import AutoFunction
from shardc.pipeline import Pipeline
from shardc.pipeline.jit import stack_of
from shardc.sharding import make_mesh
from tests.pipeline.test_pipeline_lowering import make_args, make_step


def _flax_step():
    model, tx, params, _, ids = setup(layers=4, d=32, heads=2, seq=16, scan=True)
    params = _unbox(params)
    return make_train_step(model, tx), (params, tx.init(params), ids)


@pytest.mark.parametrize("build", [lambda: (make_step(None), make_args()), _flax_step], ids=["lax.scan", "nn.scan"])
def test_the_stack_found_before_the_candidates_is_the_one_their_traces_find(build):
    step, args = build()
    with provisional_mesh(True):  # as choose_pipeline finds it
        found = stack_of(step, args, make_mesh({"data": len(jax.devices()), "model": 1, "expert": 1}))
    af = AutoFunction(step, topology="h100-sxm-8", devices=8, pipeline=Pipeline(2, 2), search="baselines")
    try:  # (the stack is found before the pipelined trace, which may want a mesh with the stage axis)
        af._trace((args, {}))
    except Exception:
        pass
    assert af._stack == found
