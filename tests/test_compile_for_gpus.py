"""Every Triton kernel the model launches compiles for each GPU target users run: A100 (sm80), L4 / L40S / RTX 4090
(sm89), H100 / H200 (sm90) and B200 (sm100), in every form its kernel tuner offers, with PDL and FP8 where the
target has them (`compile_for_gpus.py`). Without a GPU the other tests run kernels in Triton's interpreter, as
Python: what only the compiler rejects (an early `return` in a constexpr branch, a float8 type an architecture
lacks, more shared memory than the GPU has) would first fail on the GPU. Only the H200 runs them."""

import os
import re
import subprocess
import sys
from pathlib import Path

from ops_checks import needs_triton


@needs_triton
def test_kernels_compile_for_every_gpu_target():
    script = Path(__file__).with_name("compile_for_gpus.py")
    result = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "0"},
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = dict(re.findall(r"^(sm\d+): (\d+) kernels compiled", result.stdout, re.MULTILINE))
    assert compiled.keys() == {"sm80", "sm89", "sm90", "sm100"}, result.stdout
    # Without e4m3 the FP8 forms are left out, and only they.
    assert int(compiled["sm80"]) < int(compiled["sm89"]) == int(compiled["sm90"]) == int(compiled["sm100"])
