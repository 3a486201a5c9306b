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

# Steps to run, by name (default: all). Example: STEPS="device gpu_tests bench_kd_loss".
# Gold at 1x4096: STEPS="device cuda_tests bench_topm_l1 bench_kd_loss_gold profile_gold".
STEPS=${STEPS:-"device gpu_tests bench_kd_loss bench_ce bench_fused_indices bench_embedding"}
want() { [[ " $STEPS " == *" $1 "* ]]; }

want device && step device nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
# Every @pytest.mark.gpu test of the kernels and losses (the data plane's need pyzmq, which the
# GPU image lacks), then all their tests on CUDA (compiled, not interpreted).
want gpu_tests && step gpu_tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/xtoken_core/kernels \
  tests/xtoken_core/losses
want cuda_tests && step cuda_tests $PY -m pytest -q -p no:cacheprovider tests/xtoken_core/kernels \
  tests/xtoken_core/losses
want bench_kd_loss && step bench_kd_loss $PY benchmarks/losses/bench_kd_loss.py --results "$OUT/losses_kd_loss.jsonl"
want topm_tests && step topm_tests $PY -m pytest -q -p no:cacheprovider tests/xtoken_core/kernels/test_topm_l1.py
want bench_topm_l1 && step bench_topm_l1 $PY benchmarks/kernels/bench_topm_l1.py --results "$OUT/kernels_topm_l1.jsonl"
# gold at 1x4096, P-KL beside it, and a profile of one gold fwd+bwd
want bench_kd_loss_gold && step bench_kd_loss_gold $PY benchmarks/losses/bench_kd_loss.py --shapes 1x4096 \
  --modes gold xtoken pkl --results "$OUT/losses_kd_loss.jsonl"
want profile_gold && step profile_gold $PY benchmarks/losses/profile_kd_loss.py --B 1 --T 4096 \
  --paths fused --modes gold --top 16 --out "$OUT/profile"
# the spread of gold's medians between fresh inputs of one process, without and with the bench's
# reference calls before each case (placement vs clocks)
want spread_gold && step spread_gold $PY benchmarks/losses/bench_kd_spread.py --mode gold --cases 8
want spread_gold_heat && step spread_gold_heat $PY benchmarks/losses/bench_kd_spread.py --mode gold \
  --cases 6 --heat 6
# each case's kernel time and GPU idle time (the profiler slows the host: its own process)
want spread_gold_profiled && step spread_gold_profiled $PY benchmarks/losses/bench_kd_spread.py \
  --mode gold --cases 8 --profiled 10
# the student step and the pipeline: bf16 + compile against the eager baseline (needs the data
# plane's wheels: pyzmq, the tokenizer packages)
want trainer_gpu_tests && step trainer_gpu_tests $PY -m pytest -q -m gpu -p no:cacheprovider \
  tests/services/trainer tests/services/teacher tests/services/rollout tests/services/supervise/test_mps.py \
  tests/xtoken_core/kernels/test_row_ce.py
# the student step's variants (compiled, CUDA graphs, fused head) and the teacher forward's
want bench_student_step && step bench_student_step $PY benchmarks/e2e/bench_student_step.py \
  --shapes ${STEP_SHAPES:-1x4096 4x2048} ${STEP_VARIANTS:+--variants $STEP_VARIANTS} \
  --timeout ${STEP_TIMEOUT:-300} --results "$OUT/e2e_student_step.jsonl"
want bench_ce && step bench_ce $PY benchmarks/losses/bench_ce.py --results "$OUT/losses_ce.jsonl"
want bench_pipeline_pkl && step bench_pipeline_pkl $PY benchmarks/e2e/bench_pipeline.py \
  --shapes 1x4096 --modes pkl --results "$OUT/e2e_pipeline.jsonl"
want bench_pipeline && step bench_pipeline $PY benchmarks/e2e/bench_pipeline.py \
  --results "$OUT/e2e_pipeline.jsonl"
# every loss mode, default step against the eager baseline, at both shapes (no recompile check)
for mode in pkl gold xtoken ce; do
  want pipeline_$mode && step pipeline_$mode $PY benchmarks/e2e/bench_pipeline.py \
    --shapes 1x4096 4x2048 --modes $mode --recompile-steps 0 --results "$OUT/e2e_pipeline.jsonl"
done
# the default step with the teacher's layers compiled but not replayed as CUDA graphs
want teacher_no_graphs && step teacher_no_graphs $PY benchmarks/e2e/bench_pipeline.py \
  --shapes 1x4096 4x2048 --modes pkl --baseline none --no-bare --recompile-steps 0 \
  --teacher-extra '{"cuda_graphs": false}' --tag teacher-no-graphs --results "$OUT/e2e_pipeline.jsonl"
# on-policy fractions 0, 0.5, 1 (rollout workers on the same GPU)
want bench_on_policy && step bench_on_policy $PY benchmarks/e2e/bench_on_policy.py --shape 4x2048 \
  --fractions 0 0.5 1 --rollouts 2 --rollout-batch 128 --sync-every 8 --max-staleness 16 \
  --results "$OUT/e2e_on_policy.jsonl"
# one rollout worker: new tokens/s and device memory, growing vs static KV cache
want bench_rollout && step bench_rollout $PY benchmarks/e2e/bench_rollout.py --batch 64 \
  --kv-cache dynamic static --results "$OUT/e2e_rollout.jsonl"
# TRL GOLD against the default step, tokens/s and memory at 1 x 4096 (TRL importable by $PY)
want peers_speed && step peers_speed $PY benchmarks/peers/bench_trl_gold.py --parts speed --shapes 4096 \
  --teacher-tokenizer llama3 --teacher-vocab 0 --trl-python $PY --results "$OUT/peers_trl_gold.jsonl"
# packed rows of the demo corpus's texts (collator.pack, FlexAttention) against the same texts
# one per row; the filled rows of bench_pipeline are the bound packing approaches
want bench_pipeline_pack && step bench_pipeline_pack $PY benchmarks/e2e/bench_pipeline.py \
  --shapes 4x2048 1x4096 --modes pkl --pack --baseline none --tag pack --results "$OUT/e2e_pipeline.jsonl"
want bench_pipeline_demo_texts && step bench_pipeline_demo_texts $PY benchmarks/e2e/bench_pipeline.py \
  --shapes 4x2048 1x4096 --modes pkl --demo-texts --baseline none --recompile-steps 0 --tag demo-texts \
  --results "$OUT/e2e_pipeline.jsonl"
# two GPUs: 1 vs 2 trainer ranks at the same global batch (a colocated teacher each), and one
# rank fed by a teacher on the other GPU (cuda_ipc, then the hidden transport); then the
# per-step losses of 1 rank x 2 micro-batches and 2 ranks x 1 over 50 ordered steps
TWO_GPU="--trainers 1 2 --teacher-devices same cuda:1 --same-global-batch --baseline none \
  --recompile-steps 0 --no-bare --steps ${TWO_GPU_STEPS:-8} --warmup 3 --tag two-gpu"
for shape in 4x2048 1x4096; do
  for mode in pkl gold; do
    want two_gpu_${mode}_$shape && step two_gpu_${mode}_$shape $PY benchmarks/e2e/bench_pipeline.py \
      --shapes $shape --modes $mode $TWO_GPU --results "$OUT/e2e_pipeline.jsonl"
  done
done
# two ranks with the compiled layers not replayed as CUDA graphs (what the graphs give under DDP)
want two_gpu_no_graphs && step two_gpu_no_graphs $PY benchmarks/e2e/bench_pipeline.py --shapes 1x4096 \
  --modes pkl --trainers 2 --baseline none --recompile-steps 0 --no-bare --steps 8 --warmup 3 \
  --trainer-extra '{"cuda_graphs": false}' --tag two-gpu-no-graphs --results "$OUT/e2e_pipeline.jsonl"
# the DDP gradient tests on two GPUs (CUDA graphs, bf16 buckets) and a profile of 2 ranks' steps
want two_gpu_tests && step two_gpu_tests $PY -m pytest -q -p no:cacheprovider -m gpu \
  tests/services/trainer/test_data_parallel.py tests/services/trainer/test_teacher_client.py
# 1 vs 2 ranks with each GPU shared by MPS (the trainer and its teacher kernel by kernel)
want two_gpu_mps && step two_gpu_mps $PY benchmarks/e2e/bench_pipeline.py --shapes 1x4096 4x2048 \
  --modes pkl --trainers 1 2 --same-global-batch --mps --baseline none --recompile-steps 0 \
  --no-bare --steps 8 --warmup 3 --tag two-gpu-mps --results "$OUT/e2e_pipeline.jsonl"
want two_gpu_profile && step two_gpu_profile $PY benchmarks/e2e/bench_pipeline.py --shapes 1x4096 \
  --modes pkl --trainers 2 --baseline none --recompile-steps 0 --no-bare --steps 2 --warmup 3 \
  --trainer-extra '{"profile_steps": 2, "profile_start": 4}' --tag two-gpu-profile \
  --results "$OUT/e2e_pipeline.jsonl" --work /tmp/xtoken_bench_profile && \
  cp /tmp/xtoken_bench_profile/run_1x4096_pkl_cuda_ipc_r2_same/profile/* "$OUT/"
# the trainer's scheduled garbage collection (gc_every 50, the default) against Python's automatic
# one at two ranks, 1x4096, each rank's per-step times kept in the rows (plot_scaling.py draws them)
GC_AB="--shapes 1x4096 --modes pkl gold --baseline none --no-bare --recompile-steps 0 --steps 16 \
  --warmup 4 --results $OUT/e2e_pipeline.jsonl"
want two_gpu_gc && step two_gpu_gc $PY benchmarks/e2e/bench_pipeline.py $GC_AB --trainers 1 2 \
  --tag two-gpu-gc50 && step two_gpu_gc0 $PY benchmarks/e2e/bench_pipeline.py $GC_AB --trainers 2 \
  --trainer-extra '{"gc_every": 0}' --tag two-gpu-gc0 --work /tmp/xtoken_bench_gc0
want two_gpu_hidden && step two_gpu_hidden $PY benchmarks/e2e/bench_pipeline.py --shapes 4x2048 \
  --modes pkl --transports hidden --trainers 1 --teacher-devices cuda:1 --baseline none \
  --recompile-steps 0 --no-bare --steps 8 --warmup 3 --tag two-gpu --results "$OUT/e2e_pipeline.jsonl"
want two_gpu_curves && step two_gpu_curves $PY benchmarks/e2e/bench_pipeline.py --shapes 4x2048 \
  --modes pkl --trainers 1 2 --same-global-batch --ordered --baseline none --recompile-steps 0 \
  --no-bare --steps 48 --warmup 2 --tag two-gpu-curves --results "$OUT/e2e_pipeline.jsonl"
want bench_fused_indices && step bench_fused_indices $PY benchmarks/kernels/bench_fused_indices.py
want bench_embedding && step bench_embedding $PY benchmarks/ops/bench_embedding.py
exit $status
