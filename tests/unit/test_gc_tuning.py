"""The member's garbage collector tuning (``gc_tuning``, ``Runner.start``)."""

from __future__ import annotations

from kafka_idem import App


def test_the_member_tunes_the_garbage_collector_once_and_only_when_asked() -> None:
    import gc

    from kafka_idem.consume.startup import GC_YOUNG_THRESHOLD, tune_gc

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, before[1], before[2])
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        frozen = gc.get_freeze_count()
        assert frozen > 0  # what start-up made is out of every collection
        tune_gc()  # a second member in the process changes nothing: freezes nothing more
        # (never more: frozen objects other tests' threads still drop may be freed meanwhile)
        assert gc.get_freeze_count() <= frozen
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert App("off", gc_tuning=False).settings.gc_tuning is False
