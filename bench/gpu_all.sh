#!/usr/bin/env bash
# Everything that needs the GPU, in one device call: the benchmark, the CUDA tests, the demo.
# Usage (on the H200): bash bench/gpu_all.sh [bench args...]; results land in $OUT (or bench/results).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 -m qwen3vl_static bench --out "$out" "$@" 2>&1 | grep -v "Capturing decode graphs" | tee "$out/bench.log"
python3 -m pytest tests/test_cuda.py -q -s -p no:cacheprovider 2>&1 | tee "$out/cuda-tests.log"
python3 -m qwen3vl_static demo 2>&1 | grep -v "Capturing decode graphs" | tee "$out/demo.log"
