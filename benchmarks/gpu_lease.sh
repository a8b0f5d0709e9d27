#!/usr/bin/env bash
# One GPU lease's measurements for the GPU-step issue, as one prepared command. Run from the
# repository root on the GPU machine; every result lands in $OUT as soon as its part has it;
# each part runs under a hard `timeout`, in priority order, and the whole stays under $LIMIT s
# (default 470) whatever happens: a part that does not fit in the time left is skipped.
#
#   bash benchmarks/peer_src.sh PATH/TO/Fast-dLLM      (once, here: fills the ignored .peer/Fast-dLLM)
#   run(command="OUT=$OUT bash benchmarks/gpu_lease.sh", carry=[".peer"], timeout_s=540)
#   DRY=1 OUT=/tmp/lease bash benchmarks/gpu_lease.sh   (the dry run on a CPU: tiny float32 model, a few minutes)
#
# The parts, in priority order, with their time limits (s) and the estimates they rest on (one
# H200; benchmarks/results/gpu.json: Fast-dLLM's load 73 s, dlm-jax's 10 s; first decodes of
# dlm-jax 0.4-73 s of compiles per case, 6-8 s over the persistent cache; first_decode.json,
# gpu_step.json):
#   full   330  benchmarks/gpu.py, both sides, --quant none int8, --batches 1 8 16 32, --reps 3,
#               --profile, --budget-s 270 (the report is written by 330 s even when the case in
#               flight at 270 s is a cold prefix compile), of which --second-budget-s 45 for the
#               second dlm-jax process (the first decodes over the persistent cache in
#               $WORK/xla) and --peer-budget-s 120 for Fast-dLLM (its load, then b1 and b8:
#               8 + 6 + 13 + 12 s with 3 timed decodes). Estimated need: checkpoint written by
#               Fast-dLLM's code on the CPU (not measured: allow 60-120 s), Fast-dLLM 73 s + 40 s
#               at b1/b8 (+ about 45 s at b16 and 90 s at b32), dlm-jax per weight mode 10 s of
#               load + 37 s (b1) + 85 s (b8) + unmeasured b16/b32, each case + 1 profiled decode.
#               The whole table needs about 1000 s: it does not fit one lease.
#   small   50  benchmarks/gpu.py --small (the correctness half; tiny float32 twin; 30-40 s).
#   cudnn   40  benchmarks/gpu_step.py --attention cudnn, batch 1 and 8, dual and prefix.
#   scan    45  benchmarks/gpu_step.py --layers scan, batch 1 and 8, dual and prefix.
#   first  60+25  benchmarks/first_decode.py, prefix cache: cold, then a second process over its
#               cache (the dual cache's were measured: first_decode.json); runs only on what is left.
# What is cut first when time runs short: the parts after `full` (in reverse order), then inside
# `full`, by the budgets: Fast-dLLM's b16 and b32 (--peer-budget-s), then dlm-jax's last cases
# (its int8 cases come after all its unquantized ones), then the second process's. To measure
# another selection in a second lease: BATCHES="16 32" (or QUANTS="int8") with SIDES=dlm_jax.
#
# After the lease, on this machine (the files lie under the run's files_at folder, $LEASE below):
#   cp $LEASE/gpu.json benchmarks/results/gpu_parts/<device>_<what>.json   (and gpu_small.json beside it;
#   git rm the old parts whose cases the new one measures again: --merge refuses a case in two parts)
#   .venv/bin/python benchmarks/gpu.py --merge benchmarks/results/gpu_parts/*.json --out benchmarks/results/gpu
#   .venv/bin/python benchmarks/gpu_step.py --render $LEASE/cudnn.json $LEASE/scan.json --out benchmarks/results/gpu_step_lease
#   .venv/bin/python benchmarks/first_decode.py --render benchmarks/results/first_decode.json \
#     $LEASE/first_decode.json --out benchmarks/results/first_decode
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:?set OUT to the results folder}
PY=${PY:-python3}             # the GPU machine's python3 holds JAX with its CUDA plugin
LIMIT=${LIMIT:-470}           # the whole script's wall-clock seconds
WORK=${WORK:-/tmp/dlm-jax-lease}  # checkpoint and compilation caches (large: not under $OUT)
PEER=${PEER:-.peer/Fast-dLLM}
BATCHES=${BATCHES:-1 8 16 32}
QUANTS=${QUANTS:-none int8}
SIDES=${SIDES:-fast_dllm dlm_jax}
FULL_S=${FULL_S:-330} BUDGET_S=${BUDGET_S:-270} PEER_S=${PEER_S:-120} SECOND_S=${SECOND_S:-45}
SHAPE=llada-8b GPU_X=() STEP_X=() FIRST_X=()
if [ -n "${DRY:-}" ]; then  # a CPU: the tiny float32 twin, small batches, the same code paths
  SHAPE=small BATCHES=${DRY_BATCHES:-1 2}
  GPU_X=(--shape small --dtype float32 --prompt-len 32 --gen-len 64)
  STEP_X=(--shape small --dtype float32 --reps 2) FIRST_X=(--shape small --dtype float32)
  # One thread per process: torch's OpenMP threads spin against whatever else shares the CPU
  # (their tiny decodes went from 0.05 s to 2-7 s on two shared cores).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
rm -rf "$WORK/xla" "$WORK/xla-first"  # the first decodes are measured cold: no cache from an earlier run
mkdir -p "$OUT" "$WORK"
log=$OUT/log.txt
start=$SECONDS
left() { echo $((LIMIT - (SECONDS - start))); }
# part NAME LIMIT MIN CMD...: CMD under `timeout` (its whole process group), cut to the time left
# less 10 s (the kill's grace and what follows); skipped when fewer than MIN s would be left.
part() {
  local name=$1 limit=$2 min=$3 room t0=$SECONDS rc; shift 3
  room=$(( $(left) - 10 ))
  if (( room < min )); then echo "$name: skipped, $room s left (needs $min)" | tee -a "$log"; return 0; fi
  (( limit > room )) && limit=$room
  echo "$name: limit $limit s: $*" >> "$log"
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$log"
}
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv || true; } > "$OUT/smi.txt" 2>&1
[ -f "$PEER/llada/generate.py" ] || echo "no Fast-dLLM sources in $PEER: run benchmarks/peer_src.sh and carry .peer" | tee -a "$log"

G=benchmarks/gpu.py
# The budgets are of the part: a part cut to less time gets its budgets cut alike.
room=$(( $(left) - 10 )); (( room < FULL_S )) && { BUDGET_S=$(( BUDGET_S - FULL_S + room )); FULL_S=$room; }
# shellcheck disable=SC2086  # BATCHES, QUANTS and SIDES are lists of words
part full "$FULL_S" 60 $PY $G --peer-src "$PEER" --checkpoint "$WORK/ckpt-$SHAPE" --xla-cache "$WORK/xla" \
  --work "$OUT/gpu_work" --sides $SIDES --batches $BATCHES --quant $QUANTS --reps 3 --profile \
  --budget-s "$BUDGET_S" --peer-budget-s "$PEER_S" --second-budget-s "$SECOND_S" "${GPU_X[@]}" --out "$OUT/gpu"
part small 50 30 $PY $G --small --peer-src "$PEER" --checkpoint "$WORK/ckpt-small-twin" --out "$OUT/gpu_small"
S=benchmarks/gpu_step.py
part cudnn 40 25 $PY $S --batches 1 8 --kinds dual prefix --attention cudnn --reps 10 "${STEP_X[@]}" --out "$OUT/cudnn"
part scan 45 25 $PY $S --batches 1 8 --kinds dual prefix --layers scan --reps 10 "${STEP_X[@]}" --out "$OUT/scan"
F=benchmarks/first_decode.py
part "first cold" 60 40 $PY $F --cache prefix --xla-cache "$WORK/xla-first" --label cold "${FIRST_X[@]}" \
  --out "$OUT/first_decode"
part "first cache" 25 15 $PY $F --cache prefix --xla-cache "$WORK/xla-first" --label cache "${FIRST_X[@]}" \
  --out "$OUT/first_decode"
rm -f "$OUT"/*.tmp
echo "done in $((SECONDS - start)) s" | tee -a "$log"
grep -E "^(full|small|cudnn|scan|first)|wrote|FAIL|PASS|first_decode_seconds" "$log" | tail -40 || true
