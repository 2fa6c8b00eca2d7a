"""The server processes' garbage-collector handling (`gc_pauses.py`): the start-up heap frozen, the pauses counted and
the long ones logged, and `bench --server` reading those log lines."""

import gc
import logging
import re

import pytest

from qwen3vl_static import gc_pauses
from qwen3vl_static.bench_server import gc_pauses_logged
from qwen3vl_static.gc_pauses import GcPauses, freeze_startup_heap


@pytest.fixture
def unfrozen():
    """This test process's heap as it was: what a test freezes goes back to the collector."""
    yield
    gc.unfreeze()


def test_freezing_leaves_the_startup_heap_out_of_later_passes(unfrozen, caplog):
    alive = [[index] for index in range(1000)]  # tracked containers, alive at the freeze
    with caplog.at_level(logging.INFO, logger=gc_pauses.__name__):
        freeze_startup_heap("test process")
    frozen = re.search(r"test process: (\d+) objects of its start-up heap frozen out of garbage collection",
                       caplog.text)
    assert frozen and int(frozen[1]) >= gc.get_freeze_count() >= len(alive)
    # A full pass walks only what came after the freeze: the frozen objects are in no generation.
    tracked = {id(thing) for thing in gc.get_objects()}
    assert not any(id(item) in tracked for item in alive)
    cycle = []
    cycle.append(cycle)  # garbage made after the freeze is still collected
    del cycle
    assert gc.collect() >= 1


def test_pauses_are_counted_and_the_long_ones_logged(monkeypatch, caplog):
    pauses = GcPauses("test process")
    try:
        with caplog.at_level(logging.INFO, logger=gc_pauses.__name__):
            gc.collect(0)
            assert pauses.full == 0 and pauses.ms > 0 and caplog.text == ""  # a young pass, far under the limit
            monkeypatch.setattr(gc_pauses, "LONG_PAUSE_MS", 0)
            gc.collect()
        assert pauses.full == 1
        logged = gc_pauses_logged(caplog.text)
        assert logged["gc_long_pauses_http"] == 0 and logged["gc_long_pauses_engine"] == 0  # neither server process
        assert "test process: garbage collection paused it" in caplog.text and "(generation 2," in caplog.text
    finally:
        pauses.close()
    gc.collect()
    assert pauses.full == 1  # closed: no longer counting


def test_the_benchmark_reads_the_pauses_each_process_logged():
    log = ("INFO:     engine process: garbage collection paused it 12.5 ms (generation 2, 3 objects collected)\n"
           "INFO:     HTTP process [41]: garbage collection paused it 31.0 ms (generation 2, 0 objects collected)\n"
           "INFO:     HTTP process [42]: garbage collection paused it 10.2 ms (generation 1, 7 objects collected)\n")
    assert gc_pauses_logged(log) == {"gc_long_pauses_engine": 1, "gc_long_pauses_http": 2, "gc_pause_ms_max": 31.0}
    assert gc_pauses_logged("") == {"gc_long_pauses_engine": 0, "gc_long_pauses_http": 0, "gc_pause_ms_max": 0.0}
