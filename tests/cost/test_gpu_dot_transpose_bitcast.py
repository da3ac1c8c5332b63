"""XLA:GPU's layout assignment gives a dot read only by a transpose the output layout that makes the transpose a
bitcast, when a GEMM can write that layout (GpuLayoutAssignment::AddBackendConstraints, MatrixLayout::For): the
simulator prices such a transpose as free on GPU topologies, and as a copy elsewhere."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest

import shardc
from shardc.cost.program import _gemm_layout
from shardc.sim import as_topology


@pytest.mark.parametrize("perm,batch,rows,ok", [
    ((0, 1, 3, 2), 2, 1, True),   # [b, b, r, c] -> columns before rows: a column-major GEMM output
    ((0, 1, 2, 3), 2, 1, True),
    ((1, 0, 2), 1, 1, True),      # (R, B, C)
    ((2, 0, 1), 1, 1, True),      # (C, B, R)
    ((1, 2, 0), 1, 1, False),     # the batch most minor
    ((2, 1, 0), 1, 1, False),
    ((1, 0, 2, 3), 2, 1, False),  # the batch dims out of order
    ((0, 3, 1, 2), 1, 2, True),   # (B, C, R) with two row dims
    ((0, 1, 3, 2), 1, 2, False),  # the row dims split by a column dim
    ((1, 0), 0, 1, True),
])
def test_gemm_layouts(perm, batch, rows, ok):
    assert _gemm_layout(perm, batch, rows) is ok


def _transpose_times(f, args, backend: str) -> list[float]:
    """The compute time of each transpose that does work (per_op leaves out free ops)."""
    mesh = shardc.make_mesh({"data": 8})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nothing split: every device repeats the step; irrelevant here)
        plan = shardc.auto(f, mesh=mesh, search=False).plan(*args)
    topo = dataclasses.replace(as_topology("h100-sxm-8"), backend=backend)
    return [o.compute for o in shardc.simulate(plan, topo).per_op() if o.primitive == "transpose"]


X, Y, Z = jnp.ones((64, 512)), jnp.ones((64, 256)), jnp.ones((512, 128))


def test_transposed_dot_result_read_by_a_dot_is_free_on_gpu():
    def f(x, y, z):
        return jnp.einsum("bi,bj->ij", x, y).T @ z  # dot -> transpose -> dot

    assert _transpose_times(f, (X, Y, Z), "gpu") == []  # no work
    cpu = _transpose_times(f, (X, Y, Z), "")
    assert len(cpu) == 1 and cpu[0] > 0  # a copy where no backend rule applies


def test_priced_when_the_dot_has_other_readers_the_batch_would_be_minor_or_a_copy_follows():
    def two_readers(x, y, z):
        d = jnp.einsum("bi,bj->ij", x, y)
        return d.T @ z, d

    def batch_minor(x, y, z):
        d = jnp.einsum("gbi,gbj->gij", x.reshape(4, 16, 512), y.reshape(4, 16, 256))
        return jnp.einsum("ijg,jk->ikg", jnp.transpose(d, (1, 2, 0)), jnp.ones((256, 8)))

    def into_a_scan_stack(x, y, z):  # the stacked output's dynamic-update-slice copies it: priced as that copy
        def body(c, ab):
            return c, jnp.einsum("bi,bj->ij", ab[0], ab[1]).T

        return jax.lax.scan(body, 0.0, (x.reshape(4, 16, 512), y.reshape(4, 16, 256)))[1]

    for f in (two_readers, batch_minor, into_a_scan_stack):
        t = _transpose_times(f, (X, Y, Z), "gpu")
        assert t and all(v > 0 for v in t), (f.__name__, t)
