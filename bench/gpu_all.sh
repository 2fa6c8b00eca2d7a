#!/usr/bin/env bash
# Everything that needs the GPU, in one device call: kernel tests, the CUDA tests, the benchmark, the demo (and the
# probes PROBES="gemv boundary ..." names, bench/probes/<name>_probe.py; CUDA_TESTS=0 skips the CUDA tests).
# Usage (on the H200): bash bench/gpu_all.sh [bench args...]. Results land in $OUT (or bench/results): one log
# (gpu-all.log), the benchmark's JSON and PNG, and each probe's JSON.
# BENCH_RUNS="--fp8;--model 8b --fp8" runs the benchmark once per ';'-separated entry, each with the bench args and
# then the entry's own (default: one run with the bench args); each model writes its own JSON.
# `--server` needs the serve extra, which the GPU machine lacks: carry its wheels in .whl/serve/ (ignored by git), got
# once with
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl/serve \
#     "fastapi>=0.115" "pydantic>=2.5" "uvicorn>=0.30"
# and they are installed into a side directory first.
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
log="$out/gpu-all.log"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/serve/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-serve .whl/serve/*.whl
  export PYTHONPATH=/tmp/site-serve:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$log"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$log"
bench_args=("$@")
# Native kernel checks first: if a kernel is wrong here, benchmark the torch ops instead of wrong kernels.
echo "== kernel tests $(date +%T)" | tee -a "$log"
python3 -m pytest tests/test_ops_*.py tests/test_tuner.py -q -p no:cacheprovider 2>&1 | tee -a "$log" || bench_args+=(--torch-ops)
for probe in ${PROBES:-}; do
  echo "== $probe probe $(date +%T)" | tee -a "$log"
  OUT="$out" python3 "bench/probes/${probe}_probe.py" 2>&1 | tee -a "$log"
done
if [ "${CUDA_TESTS:-1}" = 1 ]; then
  echo "== CUDA tests $(date +%T)" | tee -a "$log"
  python3 -m pytest tests/test_cuda.py tests/test_cuda_fp8.py -q -s -p no:cacheprovider 2>&1 | tee -a "$log"
fi
IFS=';' read -ra bench_runs <<< "${BENCH_RUNS:-}"
[ ${#bench_runs[@]} -gt 0 ] || bench_runs=("")
for run in "${bench_runs[@]}"; do
  read -ra run_args <<< "$run"
  echo "== bench${run_args[*]:+ ${run_args[*]}} $(date +%T)" | tee -a "$log"
  python3 -m qwen3vl_static bench --out "$out" "${bench_args[@]}" "${run_args[@]}" 2>&1 | grep -v "Capturing CUDA graphs" | tee -a "$log"
done
echo "== demo $(date +%T)" | tee -a "$log"
python3 -m qwen3vl_static demo 2>&1 | grep -v "Capturing CUDA graphs" | tee -a "$log"
