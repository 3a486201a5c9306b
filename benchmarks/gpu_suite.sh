#!/usr/bin/env bash
# GPU suite: GPU tests and kernel benchmarks, one after another; logs and result rows go to $OUT.
# Usage (on a CUDA machine, repo root): OUT=/tmp/gpu_out bash benchmarks/gpu_suite.sh
# Add a step as one more `step <name> <command...>` line. Copy $OUT/*.jsonl to benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
status=0
step() {
  local name=$1; shift
  echo "== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name rc=$rc"
  [ $rc -eq 0 ] || status=1
}

step device nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
step gpu_tests_kernels $PY -m pytest -q -m gpu -p no:cacheprovider \
  tests/xtoken_core/kernels/test_chunk_log_softmax.py tests/xtoken_core/kernels/test_projection_gather.py
step bench_chunk_log_softmax $PY benchmarks/kernels/bench_chunk_log_softmax.py \
  --results "$OUT/kernels_chunk_log_softmax.jsonl"
step bench_projection_gather $PY benchmarks/kernels/bench_projection_gather.py \
  --results "$OUT/kernels_projection_gather.jsonl"
exit $status
