"""`gc_paused_long_lived` (what a simulation runs under): the collector is off during the call, on after it,
nothing is left frozen, objects the process froze itself stay frozen, and a caller's pause is kept; `frozen_heap`
(what a pipeline choice's screens run under) freezes what is alive for the block only, and never what the process
froze itself."""
import gc

from shardc.gc_pause import frozen_heap, gc_paused_long_lived


@gc_paused_long_lived
def _build(n: int) -> list[list[int]]:
    assert not gc.isenabled()
    return [[i] for i in range(n)]


def test_survivors_go_to_the_oldest_generation_and_the_collector_runs_again():
    assert gc.isenabled()
    kept = _build(1000)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 100  # (no young-generation pass owed for what the call left alive)
    assert not any(o is kept for o in gc.get_objects(generation=0))


def test_objects_the_process_froze_stay_frozen():
    # (Checked on one held object, not on the freeze count: other threads of the test process may free frozen
    # objects meanwhile, which lowers the count. Frozen objects are in none of the collector's generations.)
    held = [[]]
    gc.freeze()
    try:
        _build(100)
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert not any(o is held for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is held for o in gc.get_objects())


def test_a_paused_caller_stays_paused():
    gc.disable()
    try:
        _build(10)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_frozen_heap_leaves_what_was_alive_out_of_collections_and_gives_it_back():
    held = [[]]
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        assert not any(o is held for o in gc.get_objects())  # (frozen: in no generation)
        made = [[]]
        assert any(o is made for o in gc.get_objects())  # (what the block allocates is collected as usual)
    assert gc.get_freeze_count() == 0
    assert any(o is held for o in gc.get_objects())


def test_frozen_heap_keeps_what_the_process_froze():
    held = [[]]
    gc.freeze()
    try:
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0 and not any(o is held for o in gc.get_objects())
    finally:
        gc.unfreeze()
