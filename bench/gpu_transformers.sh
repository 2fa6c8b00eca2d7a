#!/usr/bin/env bash
# The CUDA and kernel tests on another transformers release than the GPU machine's own (5.17): the oldest (4.57)
# and newest (5.24) supported. Usage: bash bench/gpu_transformers.sh 4.57 (or 5.24), with .whl carried. The release's
# wheels travel in .whl/<release>/ (ignored by git); fetch them once with
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform any -d .whl/5.24 transformers==5.24.0 && rm .whl/5.24/numpy-*
# (4.57: --no-deps, transformers==4.57.6 "huggingface-hub==0.36.2" "tokenizers==0.22.2"). Logs land in $OUT (or
# bench/results) as transformers<release>.log.
set -uo pipefail
release=${1:?which release: a folder of .whl/}
out=${OUT:-bench/results}
mkdir -p "$out"
site=/tmp/site-$release
log="$out/transformers$release.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" ".whl/$release"/*.whl || exit 1
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
python3 -c "import transformers; print('transformers', transformers.__version__)" | tee "$log"
python3 -m pytest tests/test_cuda.py tests/test_ops_*.py tests/test_tuner.py -q -s -p no:cacheprovider 2>&1 | tee -a "$log"
