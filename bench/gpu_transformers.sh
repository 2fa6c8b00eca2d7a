#!/usr/bin/env bash
# The CUDA tests on transformers 4.57 (issue: the graph path verified on 4.57 too), on a GPU machine whose
# own transformers is 5.x. The 4.57 wheels travel in .whl/ (ignored by git); fetch them once with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
#     transformers==4.57.6 "huggingface-hub==0.36.2" "tokenizers==0.22.2"
# and run this with .whl carried. Logs land in $OUT (or bench/results).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site457 .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site457:$PWD PYTHONUNBUFFERED=1
python3 -c "import transformers; print('transformers', transformers.__version__)" | tee "$out/transformers457.log"
python3 -m pytest tests/test_cuda.py tests/test_kernels.py -q -s -p no:cacheprovider 2>&1 | tee -a "$out/transformers457.log"
