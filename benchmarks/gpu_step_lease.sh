#!/usr/bin/env bash
# One GPU lease's measurements for the GPU-step issue, as one prepared command (run from the
# repository root on the GPU machine; every result lands in $OUT; each part has its own time
# limit, so a slow part costs only itself):
#   before        the step of the commit before this work (a copy of its tree in .base/, if
#                 there): read slots gathered, then concatenated with the window
#   after         the step now (the cache read in place), bf16 and weight-only int8, batch 1-32,
#                 with each case's ten costliest kernels
#   cudnn, scan   the cuDNN fused attention form and the layers under jax.lax.scan
#   first_decode  the first decode of a fresh process: cold, then a second process over the
#                 persistent compilation cache; dual and prefix cache, unrolled layers (scanned
#                 layers were measured on 2026-11-28: benchmarks/results/first_decode.md)
# On an H200 on 2026-11-28 (9ed53ff) the parts before first_decode took 232 s, the dual first
# decodes 29 s; allow about 8 minutes of device time with the machine's start.
# Then: benchmarks/gpu_step.py --render <the json files> --out benchmarks/results/gpu_step
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the results folder}
PY=${PY:-python3}  # the GPU machine's $PY holds JAX with its CUDA plugin
X=${EXTRA:-}  # more arguments for every script (a dry run on a CPU: EXTRA="--shape small --dtype float32")
log=$OUT/log.txt
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > "$OUT/smi.txt" 2>&1
part() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" >> "$log" 2>&1; echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$log"; }
if [ -d .base ]; then
  (cd .base && part before 45 $PY gpu_step.py --batches 1 --kinds dual prefix --reps 10 --out "$OUT/before" $X)
fi
export PYTHONPATH=.
S=benchmarks/gpu_step.py
part after 230 $PY $S --batches 1 8 16 32 --kinds dual prefix --quant none int8 --profile --profile-steps 1 --reps 10 --out "$OUT/after" $X
part cudnn 40 $PY $S --batches 1 8 --kinds dual prefix --attention cudnn --reps 10 --out "$OUT/cudnn" $X
part scan 45 $PY $S --batches 1 8 --kinds dual prefix --layers scan --reps 10 --out "$OUT/scan" $X
F=benchmarks/first_decode.py
for spec in dual:cold:45 dual:cache:20 prefix:cold:100 prefix:cache:30; do
  IFS=: read -r cache run limit <<< "$spec"
  part "first $cache $run" "$limit" $PY $F --cache "$cache" --xla-cache "/tmp/xla-$cache" --label "$run" \
    --out "$OUT/first_decode" $X
done
rm -f "$OUT"/*.md "$OUT"/*.png "$OUT"/*.tmp
grep -E "exit|first_decode_seconds" "$log" | tail -20
