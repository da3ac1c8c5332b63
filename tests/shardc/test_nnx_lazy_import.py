"""Asking whether a linen step's arguments are NNX objects does not import flax.nnx (~1 s) when nothing did; once
flax.nnx is imported, NNX modules and variables are still found."""
import subprocess
import sys

_CHILD = """
import sys
import jax.numpy as jnp
import flax.linen as nn
from shardc.metadata import _is_meta
from shardc.nnx_args import split_call
params = {"w": nn.Partitioned(jnp.ones((4, 4)), ("model", None)), "b": jnp.ones(4)}
assert split_call((params, jnp.ones(2)), {}) is None
assert _is_meta(params["w"]) and not _is_meta(params["b"])
print("flax.nnx" in sys.modules)
"""


def test_linen_arguments_do_not_import_flax_nnx():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_nnx_objects_are_still_found_once_flax_nnx_is_imported():
    from flax import nnx

    from shardc.metadata import _is_meta
    from shardc.nnx_args import _is_graph_node

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    assert _is_graph_node(model) and not _is_graph_node(model.kernel)
    assert _is_meta(model.kernel)
