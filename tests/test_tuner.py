"""The measured choices (`KernelTuner`), compiling ahead, which op set runs where, and the kernels' sources as
compiling Triton parses them."""

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from ops_checks import Torch, Triton, needs_triton, poisoned_empty, randn

from qwen3vl_static import ops_norm_qwen3vl_graph as norm
from qwen3vl_static.ops_qwen3vl_graph import TorchOps, TritonOps, make_ops
from qwen3vl_static.triton_qwen3vl_graph import pdl_capable, triton
from qwen3vl_static import tuner_qwen3vl_graph as tuner_module
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

# The files that define Triton kernels.
KERNEL_MODULES = ["triton_qwen3vl_graph", "ops_norm_qwen3vl_graph", "ops_rotary_qwen3vl_graph",
                  "ops_attention_qwen3vl_graph", "ops_matmul_qwen3vl_graph", "ops_fp8_matmul_qwen3vl_graph",
                  "ops_sample_qwen3vl_graph", "ops_step_end_qwen3vl_graph", "ops_accept_qwen3vl_graph",
                  "ops_argmax_qwen3vl_graph"]


@needs_triton
@pytest.mark.skipif(not hasattr(triton, "AsyncCompileMode"), reason="needs triton.AsyncCompileMode")
def test_precompile_compiles_instead_of_running():
    """While kernels compile ahead, a launch only compiles (the interpreter has nothing to compile) and a measured op
    runs every candidate; afterwards launches run again."""
    x, weight = randn(2, 64, dtype=torch.float32), randn(64, dtype=torch.float32)
    outputs, ran = [], []

    def step():
        outputs.append(Triton.rms_norm(x, weight, 1e-6))
        Triton.tuner.measured("probe", "2 rows", x.device, (lambda: ran.append("first"), lambda: ran.append("last")))

    with poisoned_empty():
        Triton.precompile([step])
    assert outputs[0].isnan().all() and ran == ["first", "last"]
    assert ("probe", "2 rows", x.device) not in Triton.tuner.choices  # nothing was timed
    torch.testing.assert_close(Triton.rms_norm(x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6))


def test_near_ties_are_the_unsettled_choices_of_that_batch_size():
    device = torch.device("cuda", 7)  # keys only: nothing runs
    tuner = KernelTuner()
    tuner.timings = {("linear", "2x64->32 bfloat16", device): [10.0, 10.9],  # within 10%
                     ("linear", "2x64->48 bfloat16", device): [10.2, 11.5, 10.0],
                     ("linear", "2x64->96 bfloat16", device): [10.0, 11.2],  # a clear winner
                     ("linear", "2x64->128 bfloat16", device): [10.0, 10.1],  # settled already
                     ("linear", "12x64->32 bfloat16", device): [10.0, 10.1],  # another batch size
                     ("linear", "2x64->32 bfloat16", torch.device("cuda", 6)): [10.0, 10.1],  # another device
                     ("linear", "2x64->64 bfloat16", device): [10.0, 12.0, 13.0]}  # candidate 2 is timed in the step anyway
    tuner.step_timings = {("linear", "2x64->128 bfloat16", device): [1.0, 1.1]}
    tuner.in_step = {("linear", "2x64->64 bfloat16", device): (2,)}
    assert tuner.near_ties(device, 2) == {("linear", "2x64->32 bfloat16", device): [0, 1],
                                          ("linear", "2x64->48 bfloat16", device): [0, 2],
                                          ("linear", "2x64->64 bfloat16", device): [0, 2]}
    assert Torch.tuner.near_ties(device, 2) == {}


def test_op_sets_with_their_own_tuners_share_no_choices(monkeypatch):
    """What one op set measures (here with the timing stubbed, on a device that only names the keys) is its tuner's
    alone: another set's tuner stays empty, and each set has counters of its own."""
    first, second = TritonOps(KernelTuner()), TritonOps(KernelTuner())
    device = torch.device("cuda", 7)
    key = ("linear", "2x64->32 bfloat16", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    first.tuner.time_calls = lambda candidates: [2.0, 1.0, 3.0]
    candidates = tuple(lambda index=index: index for index in range(3))
    assert first.tuner.measured(*key, candidates, in_step=(2,)) == 1  # the fastest runs
    assert first.tuner.choices == {key: 1} and first.tuner.timings == {key: [2.0, 1.0, 3.0]}
    assert first.tuner.in_step == {key: (2,)} and first.tuner.near_ties(device, 2) == {key: [1, 2]}

    def unexpected(candidates):
        raise AssertionError("a shape is measured once")

    first.tuner.time_calls = unexpected
    assert first.tuner.measured(*key, candidates) == 1
    assert second.tuner.choices == second.tuner.timings == second.tuner.in_step == second.tuner.step_timings == {}
    assert second.tuner.near_ties(device, 2) == {}
    assert first.tickets is not second.tickets


def test_a_later_process_takes_the_stored_choices(tmp_path, monkeypatch, caplog):
    """Choices measured by one tuner (timing stubbed, on a device that only names the keys) are stored on disk; a new
    tuner (as in a later process) of the same device identity takes them, settled step timings included, without
    measuring; a different identity or candidate count measures again; an unreadable store measures and says so."""
    device = torch.device("cuda", 7)
    key, settled_key = ("linear", "2x64->32 bfloat16", device), ("linear", "2x64->48 bfloat16", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuner_module, "device_identity", lambda device: "an H200, torch x, triton y, code z")
    candidates = tuple(lambda index=index: index for index in range(3))

    def unexpected(candidates):
        raise AssertionError("a stored choice is not measured again")

    first = KernelTuner(cache_dir=tmp_path)
    first.time_calls = lambda candidates: [2.0, 1.0, math.inf]
    assert first.measured(*key, candidates) == 1 and first.measured(*settled_key, candidates) == 1
    first.step_timings[settled_key], first.choices[settled_key] = [0.9, 1.0, None], 0  # as warmup settles it
    first.keep(settled_key)

    later = KernelTuner(cache_dir=tmp_path)
    later.time_calls = unexpected
    assert later.measured(*key, candidates, in_step=(2,)) == 1 and later.measured(*settled_key, candidates) == 0
    assert later.timings[key] == [2.0, 1.0, math.inf] and later.in_step[key] == (2,)
    assert later.step_timings == {settled_key: [0.9, 1.0, None]}
    assert later.near_ties(device, 2) == {key: [1, 2]}  # the settled one is not settled again

    measured = []
    other = KernelTuner(cache_dir=tmp_path)
    other.time_calls = lambda candidates: measured.append(len(candidates)) or [1.0] * len(candidates)
    assert other.measured(*key, candidates[:2]) == 0 and measured == [2]  # the candidates changed
    monkeypatch.setattr(tuner_module, "device_identity", lambda device: "another GPU")
    assert KernelTuner(cache_dir=tmp_path).stored(key, 3) is None

    monkeypatch.setattr(tuner_module, "device_identity", lambda device: "an H200, torch x, triton y, code z")
    store, = (tmp_path / "tuner").glob("*.json")
    store.write_text("{not json")
    broken = KernelTuner(cache_dir=tmp_path)
    broken.time_calls = lambda candidates: [3.0, 1.0, 2.0]
    with caplog.at_level(logging.WARNING):
        assert broken.measured(*key, candidates) == 1
    assert "Could not read the stored kernel choices" in caplog.text
    assert json.loads(store.read_text())["choices"]["linear|2x64->32 bfloat16"]["choice"] == 1  # written whole again


def test_the_store_is_off_when_the_environment_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("QWEN3VL_STATIC_CACHE_DIR", "")
    assert KernelTuner().cache_dir is None and KernelTuner().store(torch.device("cuda", 7)) is None
    monkeypatch.setenv("QWEN3VL_STATIC_CACHE_DIR", str(tmp_path))
    assert KernelTuner().cache_dir == tmp_path
    monkeypatch.delenv("QWEN3VL_STATIC_CACHE_DIR")
    assert KernelTuner().cache_dir == Path.home() / ".cache" / "qwen3vl_static"


def test_ops_selection():
    assert not pdl_capable(torch.device("cpu"))
    tuner = KernelTuner()
    for device, dtype, allow in (("cpu", torch.bfloat16, True),
                                 ("cuda", torch.float32, True),  # tl.dot would round to TF32
                                 ("cuda", torch.bfloat16, False)):
        ops = make_ops(torch.device(device), dtype, allow, tuner)
        assert type(ops) is TorchOps and ops.tuner is tuner
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):  # an H200's, without one here
        ops = make_ops(torch.device("cuda"), torch.bfloat16, True, tuner)
    assert type(ops) is (TritonOps if triton is not None else TorchOps) and ops.tuner is tuner


@needs_triton
@pytest.mark.slow
def test_kernel_sources_parse_as_compiling_triton_parses_them():
    """The interpreter runs a kernel's Python; compiling Triton first parses its source for the cache key, and older
    releases reject constructs that newer ones accept (Triton 3.6, the H200's, rejects a nested tuple assignment
    that 3.9 parses). So a process without the interpreter (no GPU needed) builds every kernel's cache key; CI runs
    this under Triton 3.6 in one leg."""
    package = Path(norm.__file__).parent
    script = ("import importlib, triton; "
              f"modules = [importlib.import_module('qwen3vl_static.' + name) for name in {KERNEL_MODULES!r}]; "
              "jitted = [f for m in modules for f in vars(m).values() "
              "          if isinstance(f, triton.runtime.jit.JITFunction) and f.fn.__module__ == m.__name__]; "
              "[f.cache_key for f in jitted]; print(len(jitted))")
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "0"},
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    defined = sum((package / f"{name}.py").read_text().count("@triton.jit") for name in KERNEL_MODULES)
    assert int(result.stdout.split()[-1]) == defined
    every_jit = sum(path.read_text().count("@triton.jit") for path in package.glob("*.py"))
    assert defined == every_jit  # no kernel file left out of the list
