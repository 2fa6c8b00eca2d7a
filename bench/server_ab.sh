#!/usr/bin/env bash
# bench --server on several trees of the code in one device call, one after another (alternate them: A B A), each
# with its own environment, within a deadline: what an A/B of server changes needs on one machine.
# Usage (on the GPU machine): VARIANTS="main green:QWEN3VL_STATIC_SIDE_SMS=66 main" bash bench/server_ab.sh [bench args]
# Each variant is TREE[:NAME=VALUE,...]; TREE is $TREES/TREE.tar (default .ab/trees, ignored by git: carry it), made
# here with `git archive -o .ab/trees/TREE.tar BRANCH`. Bench args default to 64 clients x 12 requests. LIMIT: the
# seconds the whole may take (default 560); a variant that would start with less than 120 s left is skipped. The
# serve extra's wheels come from .whl/serve (bench/gpu_all.sh says how to get them). Results: $OUT/gpu.log (each run's
# second-pass rows) and $OUT/<n>-<tree>/ (each run's JSON).
set -uo pipefail
t0=$(date +%s); limit=${LIMIT:-560}; trees=${TREES:-.ab/trees}
left() { echo $(( limit - ($(date +%s) - t0) )); }
out=${OUT:-bench/results}; mkdir -p "$out"; log="$out/gpu.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log"
echo "variants: ${VARIANTS}" | tee -a "$log"; date | tee -a "$log"
site=/tmp/site-serve
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/serve/*.whl \
  >/dev/null 2>&1 || echo "serve wheels: not installed" | tee -a "$log"
export PYTHONUNBUFFERED=1
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--server-concurrency 64 --server-requests-per-client 12)
index=0
for variant in ${VARIANTS}; do
  index=$((index + 1)); tree=${variant%%:*}; envs=()
  [[ "$variant" == *:* ]] && IFS=',' read -ra envs <<< "${variant#*:}"
  dir=/tmp/trees/$tree
  [ -d "$dir" ] || { mkdir -p "$dir" && tar -xf "$trees/$tree.tar" -C "$dir"; }
  seconds=$(left)
  if [ "$seconds" -lt 120 ]; then echo "== $index $variant skipped: $seconds s left" | tee -a "$log"; continue; fi
  [ "$seconds" -gt 260 ] && seconds=260
  # `git archive` writes the commit into the tar's pax header: each run names the code it ran.
  commit=$(python3 -c 'import sys, tarfile; print(tarfile.open(sys.argv[1]).pax_headers.get("comment", "?"))' \
    "$trees/$tree.tar")
  echo "== $index $variant (commit $commit): bench --server ${args[*]} (timeout $seconds s) $(date +%T)" | tee -a "$log"
  (cd "$dir" && env "${envs[@]}" PYTHONPATH="$site:$dir" timeout "$seconds" python3 -m qwen3vl_static bench --server \
    --out "$out/$index-$tree" "${args[@]}" 2>&1 \
    | grep -E '^\{"run": "second"|answers_equal|wrote|Error|error|Traceback' | tee -a "$log")
done
echo "== end $(date +%T)" | tee -a "$log"
