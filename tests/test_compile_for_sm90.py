"""The skinny matmul's kernels compile for an H200 at the forms and tilings the tuner offers. Without a GPU the other
tests run kernels in Triton's interpreter, as Python: what only the compiler rejects (an early `return` in a constexpr
branch, say) would first fail on the GPU."""

import os
import subprocess
import sys
from pathlib import Path

from ops_checks import needs_triton


@needs_triton
def test_skinny_matmul_kernels_compile_for_sm90():
    script = Path(__file__).with_name("compile_for_sm90.py")
    result = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "0"},
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "kernels compiled for sm_90" in result.stdout
