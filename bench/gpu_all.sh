#!/usr/bin/env bash
# Everything that needs the GPU, in one device call: kernel tests, the benchmark, the CUDA tests, the demo.
# Usage (on the H200): bash bench/gpu_all.sh [bench args...]; results land in $OUT (or bench/results).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
bench_args=("$@")
# Native kernel checks first: if a kernel is wrong here, benchmark the torch ops instead of wrong kernels.
python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider 2>&1 | tee "$out/kernel-tests.log" || bench_args+=(--torch-ops)
python3 -m qwen3vl_static bench --out "$out" "${bench_args[@]}" 2>&1 | grep -v "Capturing decode graphs" | tee "$out/bench.log"
python3 -m pytest tests/test_cuda.py -q -s -p no:cacheprovider 2>&1 | tee "$out/cuda-tests.log"
python3 -m qwen3vl_static demo 2>&1 | grep -v "Capturing decode graphs" | tee "$out/demo.log"
