"""Reading collectives out of HLO text: tuple-shaped, async, combined, every replica-group syntax, loops."""
from shardc.cost.hlo import collectives, shape_bytes

MESH = [("data", 2), ("model", 4)]

HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}

%body (p: (s32[], f32[16,64])) -> (s32[], f32[16,64]) {
  %p = (s32[], f32[16,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[16,64]{1,0} get-tuple-element(%p), index=1
  %ar.loop = f32[16,64]{1,0} all-reduce(%v), channel_id=9, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[16,64]{1,0}) tuple(%i, %ar.loop)
}

%cond (p.1: (s32[], f32[16,64])) -> pred[] {
  %p.1 = (s32[], f32[16,64]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%async_ag (ag.p: f32[8,128]) -> f32[16,128] {
  %ag.p = f32[8,128]{1,0} parameter(0)
  ROOT %ag.inner = f32[16,128]{1,0} all-gather(%ag.p), channel_id=7, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
}

ENTRY %main (a: f32[64], b: f32[64,64], c: f32[16,64], d: f32[4,32]) -> f32[] {
  %a = f32[64]{0} parameter(0)
  %b = f32[64,64]{1,0} parameter(1)
  %c = f32[16,64]{1,0} parameter(2)
  %d = f32[4,32]{1,0} parameter(3)
  %combined = (f32[64]{0}, f32[64,64]{1,0}, /*index=2*/f32[]) all-reduce(%a, %b, /*index=2*/f32[] %zero), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %ags = ((f32[4,32]{1,0}), f32[16,32]{1,0}) all-gather-start(f32[4,32]{1,0} %d), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %agd = f32[16,32]{1,0} all-gather-done(%ags)
  %ars = f32[16,64]{1,0} all-reduce-start(%c), channel_id=3, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = f32[16,64]{1,0} all-reduce-done(%ars)
  %rs = f32[4,64]{1,0} reduce-scatter(%c), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, to_apply=%add
  %a2a = (f32[8,1,32]{2,1,0}, f32[8,1,32]{2,1,0}) all-to-all(%x1, %x2), channel_id=5, replica_groups={{0,4},{1,5},{2,6},{3,7}}
  %sub = (f32[1,1,1]{2,1,0}, f32[1,1,1]{2,1,0}) all-to-all(%s1, %s2), channel_id=8, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_1':(2)2}
  %submajor = f32[16,64]{1,0} all-reduce(%c), channel_id=10, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1':(1)2}, to_apply=%add
  %cps = (f32[16,64]{1,0}, f32[16,64]{1,0}, u32[], u32[]) collective-permute-start(%c), channel_id=6, source_target_pairs={{0,1},{1,0},{4,5},{5,4}}
  %cpd = f32[16,64]{1,0} collective-permute-done(%cps)
  %as = ((f32[8,128]{1,0}), f32[16,128]{1,0}) async-start(%e), calls=%async_ag
  %w = (s32[], f32[16,64]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[] constant(0)
}
"""


def test_shape_bytes():
    assert shape_bytes("f32[16,64]{1,0}") == 4096
    assert shape_bytes("(f32[64]{0}, bf16[8,8]{1,0}, /*index=2*/pred[3])") == 256 + 128 + 3
    assert shape_bytes("s4[3]") == 2 and shape_bytes("token[]") == 0 and shape_bytes("f32[]") == 4


def test_collectives_of_every_form():
    got = {c.name: c for c in collectives(HLO, MESH)}
    comb = got["combined"]
    assert (comb.kind, comb.bytes, comb.tensors, comb.axes, comb.group_size) == ("all-reduce", 256 + 16384 + 4, 3, ("data",), 2)
    ags = got["ags"]  # async all-gather: payload is the gathered result (operand x group)
    assert (ags.kind, ags.bytes, ags.axes, ags.group_size) == ("all-gather", 512 * 4, ("model",), 4)
    assert "agd" not in got and "ard" not in got and "cpd" not in got  # -done halves are not counted twice
    ars = got["ars"]
    assert (ars.kind, ars.bytes, ars.axes) == ("all-reduce", 4096, ("model",))
    rs = got["rs"]  # mesh groups with a device order: devices {0,4},{1,5},... vary along data only
    assert (rs.kind, rs.bytes, rs.axes) == ("reduce-scatter", 4096, ("model",))
    a2a = got["a2a"]  # operands printed without shapes and not defined here count as zero; groups span data
    assert a2a.kind == "all-to-all" and a2a.axes == ("data",) and a2a.tensors == 2
    cps = got["cps"]
    assert (cps.kind, cps.bytes, cps.axes) == ("collective-permute", 4096, ("model",))
    inner = got["ag.inner"]  # inside an async computation: counted once
    assert (inner.kind, inner.bytes, inner.count, inner.axes) == ("all-gather", 4096 * 2, 1, ("data",))
    loop = got["ar.loop"]  # inside a while body with a known trip count
    assert (loop.count, loop.total_bytes) == (3, 3 * 4096)
    # a sub-axis `'name':(pre)size` (Shardy's): the minor half of model, over devices ordered [2,2,2]T(1,0,2)
    # (mesh rows 0 1 4 5 / 2 3 6 7): groups {0,1}, {4,5}, {2,3}, {6,7}, of two, along model
    sub = got["sub"]
    assert (sub.kind, sub.group_size, sub.axes) == ("all-to-all", 2, ("model",))
    submajor = got["submajor"]  # data and the major half of model: {0,2,4,6} and {1,3,5,7}
    assert (submajor.group_size, submajor.axes) == (4, ("data", "model"))
    assert set(got) == {"combined", "ags", "ars", "rs", "a2a", "cps", "ag.inner", "ar.loop", "sub", "submajor"}


def test_without_mesh_axes_are_unknown():
    cs = collectives(HLO)
    assert all(c.axes is None for c in cs) and len(cs) == 10
