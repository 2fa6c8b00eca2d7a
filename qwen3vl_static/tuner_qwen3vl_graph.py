# Copyright 2026 The qwen3vl-static Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""`KernelTuner`: which of an op's candidate forms runs (cuBLAS or unfused kernels, a skinny matmul at some tiling, a
fused epilogue), measured once per shape and device. Each engine owns one, so two models in a process never share
choices unseen; the choices are also kept on disk (`ChoiceStore`), so a later process on the same GPU, torch, Triton
and kernels takes them instead of measuring again, as Triton takes its compiled kernels from its disk cache.
"""

import hashlib
import json
import math
import os
import statistics
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging

from .ops_matmul_qwen3vl_graph import silu_mul
from .triton_qwen3vl_graph import compiling, triton

# What a launch raises on a GPU that lacks the resources its kernel was compiled for: the skinny matmul's 6-stage and
# preloaded tilings take up to 160 KB of shared memory, an L4, L40S or RTX 4090 has 99 KB per block.
OutOfResources = triton.runtime.errors.OutOfResources if triton is not None else ()

logger = logging.get_logger(__name__)

# Where the measured choices are kept; set to an empty string to measure in every process.
CACHE_DIR_VARIABLE = "QWEN3VL_STATIC_CACHE_DIR"
# The files whose code decides what the candidates are: any change to them starts a new store.
CANDIDATE_SOURCES = ("ops_*qwen3vl_graph.py", "triton_qwen3vl_graph.py", "tuner_qwen3vl_graph.py")


def default_cache_dir() -> Path | None:
    """`$QWEN3VL_STATIC_CACHE_DIR`, else `~/.cache/qwen3vl_static`; None where the variable is set empty."""
    value = os.environ.get(CACHE_DIR_VARIABLE)
    if value is None:
        return Path.home() / ".cache" / "qwen3vl_static"
    return Path(value) if value else None


def device_identity(device) -> str:
    """What the timings depend on besides the shape: the GPU, its software, and the candidates' code."""
    code = hashlib.sha256()
    for pattern in CANDIDATE_SOURCES:
        for path in sorted(Path(__file__).parent.glob(pattern)):
            code.update(path.name.encode() + path.read_bytes())
    properties = torch.cuda.get_device_properties(device)
    return (f"{properties.name} sm{properties.major}{properties.minor} torch {torch.__version__} "
            f"triton {getattr(triton, '__version__', None)} code {code.hexdigest()[:16]}")


class ChoiceStore:
    """The measured choices of one device identity in a JSON file under `folder`: {"op|shape": {"candidates": how many
    there were, "choice": the index chosen, "timings": µs alone, "step_timings": ms per step where settled there}}.
    Reading or writing it never fails a call: a problem is logged once and the tuner measures as without it."""

    def __init__(self, folder: Path, identity: str):
        self.path = folder / "tuner" / f"{hashlib.sha256(identity.encode()).hexdigest()[:24]}.json"
        self.identity = identity
        self.entries = self._read()

    def _read(self) -> dict:
        try:
            stored = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            logger.warning_once(f"Could not read the stored kernel choices {self.path} ({error}); measuring instead.")
            return {}
        return stored.get("choices", {}) if stored.get("identity") == self.identity else {}

    def get(self, op: str, shape: str, candidates: int) -> dict | None:
        entry = self.entries.get(f"{op}|{shape}")
        return entry if entry is not None and entry.get("candidates") == candidates else None

    def put(self, op: str, shape: str, entry: dict) -> None:
        """Keep `entry`, with what other processes stored meanwhile (the file is replaced whole, never half written)."""
        self.entries = {**self._read(), **self.entries, f"{op}|{shape}": entry}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as file:
                json.dump({"identity": self.identity, "choices": self.entries}, file)
            os.replace(file.name, self.path)
        except OSError as error:
            logger.warning_once(f"Could not store the measured kernel choices in {self.path} ({error}).")


class KernelTuner:
    """The measured choices of one engine, and how they are measured.

    `choices`: (op, shape description, device) -> index of the candidate that measured fastest; `timings`: the same
    keys -> each candidate's microseconds (reported by the benchmark); `step_timings`: the keys settled in the whole
    step (`near_ties`) -> each candidate's ms per step (None: not a near tie); `in_step`: the same keys -> candidates
    timed in the step however they time alone (`measured`). Candidates timed alone within `near_tie` of the fastest
    are timed again in the whole step. `cache_dir`: where choices are kept between processes (`ChoiceStore`; default
    `default_cache_dir()`, which the environment can turn off).
    """

    # GPU cycles (~0.5 ms) of busy wait before each timed call: longer than the host takes to launch the call's kernels
    # (0.1 ms is too short on an H200: with each kernel launched from the host, a slow host's launches reach the timings).
    SPIN_CYCLES = 1_000_000

    def __init__(self, near_tie: float = 1.10, cache_dir: Path | None = None):
        self.choices = {}
        self.timings = {}
        self.step_timings = {}
        self.in_step = {}
        self.near_tie = near_tie
        self.cache_dir = default_cache_dir() if cache_dir is None else cache_dir
        self.stores = {}  # device -> its ChoiceStore (None: not kept)

    def store(self, device) -> ChoiceStore | None:
        if device not in self.stores:
            self.stores[device] = None if self.cache_dir is None else ChoiceStore(self.cache_dir,
                                                                                 device_identity(device))
        return self.stores[device]

    def keep(self, key) -> None:
        """Store `key`'s choice and timings for later processes."""
        store = self.store(key[2])
        if store is not None:
            store.put(key[0], key[1], {"candidates": len(self.timings[key]), "choice": self.choices[key],
                                       "timings": self.timings[key], "step_timings": self.step_timings.get(key)})

    def measured(self, op, shape, device, candidates, in_step=()):
        """Run whichever of `candidates` (calls of no arguments, the first the cuBLAS / unfused one) measured fastest
        for `op` on operands described by `shape` (a string: rows, sizes, dtype) on this device. `in_step`: indices of
        candidates timed in the whole step however they time alone (`near_ties`).

        Each shape is measured once, on first use: in the runner that is a warm-up step, which the graph capturer
        runs twice on a side stream before capturing. Timing needs a sync, which capture forbids, so a shape first
        met during capture runs the first candidate in that graph and is measured the next time it runs outside
        capture. Off CUDA (the interpreter tests) the last (most fused) candidate always runs, so the CPU tests
        take it through the whole decode loop.
        """
        if compiling():  # compiling ahead: every candidate's kernels, none timed
            for candidate in candidates[:-1]:
                candidate()
            return candidates[-1]()
        if device.type != "cuda":
            return candidates[-1]()
        key = (op, shape, device)
        choice = self.choices.get(key)
        if choice is None and (stored := self.stored(key, len(candidates))) is not None:
            self.timings[key], self.in_step[key] = stored["timings"], in_step
            if stored["step_timings"] is not None:
                self.step_timings[key] = stored["step_timings"]
            choice = self.choices[key] = stored["choice"]
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                return candidates[0]()
            times = self.timings[key] = self.time_calls(candidates)
            self.in_step[key] = in_step
            choice = self.choices[key] = times.index(min(times))
            logger.info(f"{op} {shape}: " + ", ".join(f"candidate {index} {us:.1f} us" for index, us in enumerate(times))
                        + f"; using {choice}")
            self.keep(key)
        return candidates[choice]()

    def stored(self, key, candidates: int) -> dict | None:
        """What a process before stored for `key` with as many candidates (None: nothing)."""
        store = self.store(key[2])
        return None if store is None else store.get(key[0], key[1], candidates)

    def near_ties(self, device, rows) -> dict:
        """The measured choices for `rows`-row operands on `device`, not yet settled in the step, whose candidates
        timed alone came within `near_tie` of the fastest or are timed in the step anyway (`measured`'s `in_step`):
        {key: those candidates' indices}, for two or more. Alone, a call misses how it overlaps its real neighbours
        under PDL: on an H200 the fused QKV form is 0.16 µs slower alone and 0.017 ms/step faster in the step at
        batch 1, 9% slower alone and 0.066 ms/step faster at batch 4, so the decode runner times the whole step."""
        ties = {key: [index for index, us in enumerate(times)
                      if us <= self.near_tie * min(times) or index in self.in_step.get(key, ())]
                for key, times in self.timings.items()
                if key[2] == device and key[1].startswith(f"{rows}x") and key not in self.step_timings}
        return {key: indices for key, indices in ties.items() if len(indices) > 1}

    def time_calls(self, candidates, reps=20) -> list:
        """Median microseconds of each call (with its two neighbours, below), as in the decode graph: each call is
        captured as a CUDA graph of its own (its kernels then follow each other as closely as in the step; launched
        one by one from the host, a call of several kernels would also pay the gaps between launches), the GPU
        replays it without waiting for the host (a spin kernel covers the launch) and reads the weights from HBM, as
        the step does with weights far larger than L2 (reading twice L2's size first evicts it, leaving no dirty
        lines to write back). In the step a call sits between other kernels, which under programmatic dependent
        launch overlap its start and its end (Triton kernels do, cuBLAS does not): each graph puts the call between
        two small Triton kernels, so that overlap counts.
        A candidate whose kernel needs more than the GPU has (shared memory) times `inf`.
        Synchronizes the device: each capture does, and the timings are read at the end."""
        device = torch.cuda.current_device()
        neighbour = torch.randn(1, 2048, dtype=torch.bfloat16, device=device)  # the step's SwiGLU kernel, compiled

        def between_neighbours(candidate):
            silu_mul(neighbour)
            candidate()
            silu_mul(neighbour)

        graphs = []
        for index, candidate in enumerate(candidates):
            try:
                for _ in range(3):  # compiles the kernels, warms cuBLAS, measures the ops a candidate itself dispatches
                    between_neighbours(candidate)
            except OutOfResources as error:  # raised at its first launch, before it ran: never chosen
                logger.info(f"candidate {index} cannot run on this GPU: {error}")
                graphs.append(None)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as the capturer's graphs
                between_neighbours(candidate)
            graphs.append(graph)
        flush = torch.empty(torch.cuda.get_device_properties(device).L2_cache_size // 2, dtype=torch.float32, device=device)
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
                  for _ in candidates]
        for rep in range(reps):
            for graph, pairs in zip(graphs, events):
                if graph is None:
                    continue
                flush.sum()
                torch.cuda._sleep(self.SPIN_CYCLES)
                start, end = pairs[rep]
                start.record()
                graph.replay()
                end.record()
        torch.cuda.synchronize(device)
        return [1000 * statistics.median(start.elapsed_time(end) for start, end in pairs) if graph is not None
                else math.inf for graph, pairs in zip(graphs, events)]
