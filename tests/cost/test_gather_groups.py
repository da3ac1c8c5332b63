"""The model of XLA's gather/scatter regrouping (shardc.cost.gather_groups), without compiling: which tensors
move on a 2x2x2 mesh (the compiled programs are checked in tests/fuzz/test_fuzz_regressions.py), and the
dry-run costs XLA logs (TF_CPP_VMODULE=gather_scatter_handler=5) for the methods it chooses between."""
import pytest

from shardc.cost.gather_groups import _Case, _ip_cost, _ts_cost, ip_moves, on_dims, ts_moves
from shardc.sharding import Sharding

MESH = {"x": 2, "y": 2, "z": 2}


def _split(rank: int, dim: int, *axes: str) -> Sharding:
    return Sharding(tuple(tuple(axes) if d == dim else () for d in range(rank)))


def test_groups_on_a_dim_follow_its_tiles_and_order_the_rest_by_mesh_axes():
    g = on_dims(_split(2, 0, "z"), [0], MESH)  # devices in mesh order: (x, y, z)
    assert g.group == (0, 1) * 4  # by z
    assert g.position == (0, 0, 1, 1, 2, 2, 3, 3)  # by (x, y)


@pytest.mark.parametrize("operand, indices, moves", [
    (("z",), ("y",), ("x", "y")),  # the indices' groups follow x, the operand's z: XLA swaps 2 and 4, 3 and 5
    (("y",), ("z",), ("x", "y", "z")),  # XLA pairs 4->2, 2->1, 1->4: a cycle over all three
    (("z",), ("x",), ()),  # groups follow y, not z; but in a z group, x orders the devices first: no tile moves
    (("x",), ("y",), ()),  # the indices' groups follow x, as the operand's
    (("z", "x"), ("y",), ()),  # groups numbered z-major and x-major: same devices per tile
    (("z",), ("x", "y"), ()),  # replicated over z only: the operand's groups
])
def test_which_layouts_xla_permutes_under_the_trivially_sliced_method(operand, indices, moves):
    (got,) = ts_moves(_split(2, 0, *operand), [0], [_split(3, 0, *indices)], MESH)
    assert got == moves


def test_a_tensor_no_axis_splits_never_moves():
    assert ts_moves(_split(2, 0, "z"), [0], [Sharding(((), (), ()))], MESH) == ((),)


def test_index_passthrough_moves_the_operand_when_its_groups_differ():
    assert ip_moves(_split(2, 0, "z"), _split(3, 0, "y"), [0, 1], MESH) != ()
    assert ip_moves(_split(2, 0, "z"), _split(3, 0, "x"), [0, 1], MESH) == ()  # its replicated x, y: x groups


@pytest.mark.parametrize("case, ts, ip", [
    # (operand, indices, result or updates bytes; pieces a, b): XLA's logged (largest buffer, communication)
    (_Case(32, 8, 16, 2, 2, (0, 1), False), (40, 32), (48, 32)),  # gather of 2 rows of a [4, 2] table
    (_Case(32, 64, 128, 2, 2, (0, 1), False), (208, 256), (128, 32)),  # 16 rows: index passthrough
    (_Case(32, 8, 16, 2, 2, (0, 1), True), (40, 24), (48, 80)),  # its gradient, a scatter-add
    (_Case(32, 64, 128, 2, 2, (0, 1), True), (208, 192), (128, 80)),
])
def test_dry_run_costs_are_what_xla_logs(case, ts, ip):
    assert _ts_cost(case) == ts and _ip_cost(case) == ip
