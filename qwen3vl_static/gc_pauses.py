"""Python's garbage collector in the server's processes: the heap they build at start-up frozen out of its passes, and
its pauses counted. Not uploaded to the Hub.

A pass over the oldest generation walks every object the collector tracks and holds the interpreter lock throughout.
A server process tracks ~380,000 (engine) to ~400,000 (HTTP) objects once torch, transformers and the web framework
are imported, nearly all of them there for the process's life. `bench/probes/gc_pause_probe.py` (a tiny model served
on the 2-core development machine, 600 streaming requests a run): every run's HTTP process made one such pass while
streaming, 162-252 ms, in which each of its streams stood still. Frozen (`gc.freeze`, as vLLM's and SGLang's server
processes do once started), those objects are left out of every later pass, which walks only what serving allocated
since: no full pass came in any run.
"""

import gc
import logging
import time

logger = logging.getLogger(__name__)

LONG_PAUSE_MS = 10  # a pause this long or longer is logged: a decode step or more of every stream the process serves


def freeze_startup_heap(process: str) -> None:
    """Everything alive in this process now, after one full collection, left out of the collector's later passes.
    Call it once the process is built and before it serves: a cycle among the objects it freezes is never collected
    (reference counting still frees the others)."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info("%s: %d objects of its start-up heap frozen out of garbage collection (%.0f ms)", process,
                gc.get_freeze_count(), 1000 * (time.perf_counter() - began))


class GcPauses:
    """The collector's passes in this process (`gc.callbacks`) from now on: their time (`ms`), the full ones (`full`,
    over the oldest generation) and a log line for each pause of LONG_PAUSE_MS or more, naming `process`."""

    def __init__(self, process: str):
        self.process = process
        self.ms, self.full = 0.0, 0
        self._began = 0.0
        gc.callbacks.append(self._passed)

    def close(self) -> None:
        gc.callbacks.remove(self._passed)

    def _passed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        ms = 1000 * (time.perf_counter() - self._began)
        self.ms += ms
        self.full += info["generation"] == 2
        if ms >= LONG_PAUSE_MS:
            logger.info("%s: garbage collection paused it %.1f ms (generation %d, %d objects collected)", self.process,
                        ms, info["generation"], info["collected"])
