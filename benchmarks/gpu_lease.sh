#!/usr/bin/env bash
# One GPU lease's measurements for the GPU-step issue, as one prepared command. Run from the
# repository root on the GPU machine; every result is packed into $OUT as soon as its part has it
# (two archives and the log: a call brings back at most 8 files);
# each part runs under a hard `timeout`, in priority order, cut to the time left, and the whole
# stays under $LIMIT s (default 470) whatever happens: a part that no longer fits is skipped,
# and a part that ends early leaves its time to the next.
#
#   bash benchmarks/peer_src.sh PATH/TO/Fast-dLLM      (once, here: fills the ignored .peer/Fast-dLLM)
#   run(command="OUT=$OUT bash benchmarks/gpu_lease.sh", carry=[".peer"], timeout_s=540)
#   DRY=1 OUT=/tmp/lease PY=.venv/bin/python bash benchmarks/gpu_lease.sh   (a CPU: tiny float32 twin, ~4 min)
#
# Each call's results (RES, a new folder under $WORK unless given) come back as $OUT/lease.tar.gz
# (reports), $OUT/lease_extra.tar.gz (plots, workers' files, autotuning results) and $OUT/log.txt.
# After a call, with FILES its files_at folder:
#   LEASE=/tmp/lease; mkdir -p $LEASE && for a in FILES/lease*.tar.gz; do tar -xzf $a -C $LEASE; done
# (a second call's into a folder of its own: its parts write the same names, gpu_dual.json among them).
#
# The parts in priority order (PARTS), their limits (s), and the estimates they rest on (one
# H200: benchmarks/results/gpu.json, gpu_step*.json, first_decode.json). The table's both sides
# at batch 1 and 8, unquantized, were measured on 2026-11-28 (benchmarks/results/gpu_parts/);
# what the issue still lacks comes first: int8, and batch 16 and 32.
#   target  20  benchmarks/gpu_step.py --write-target: the device as XLA's compile-only client
#                takes it (target_config.txtpb), for `gpu_step.py --target FILE` on a machine
#                without a GPU (benchmarks/targets/h200.txtpb is written from the datasheet).
#   attncheck 60 benchmarks/attention_check.py: one layer's attention at the 8B shape and at a
#                grouped-query 8B shape (32 query heads over 8 K/V heads: the kernel's programs
#                take 4 query heads each), dual and prefix steps at batch 1 and 8, in the split,
#                cudnn, cudnn_split and pallas forms against float32 (seconds: 32 small
#                programs); whether cuDNN's log-sum-exp merges
#                as JAX's XLA attention standing in for it does on a CPU, and the Triton kernel
#                computes what Pallas's interpreter does (benchmarks/results/
#                attention_check_stand_in.md), and rows that see no cache slot stay finite.
#   decide 120  benchmarks/gpu_step.py --attention split pallas --projections separate fused,
#                dual steps at batch 1 and 8 (8 programs, two sets of weights made; the fused
#                part took 8 programs in its 90 s estimate), then benchmarks/gpu_decide.py: the
#                fastest of the four (geometric mean of the step times over split/separate's,
#                at least 3% under it, the kernel only where attncheck passed it) becomes the
#                ATTENTION and PROJECTIONS of every gpu.py and first_decode.py part after it
#                (decide.md says why; $WORK/decided.env keeps it for a later call on the
#                warm machine). The table is then measured in the form the defaults will take,
#                not in the one they leave. Skipped where ATTENTION or PROJECTIONS is given.
#   dual   330  benchmarks/gpu.py --sides dlm_jax --caches dual --quant none int8, batch 1, 16,
#                32, 8 (in that order: the budget cuts the last; 1, 8, 16, 32 where decide chose
#                another form than split/separate, whose b1 and b8 are the targets' and were
#                never timed), --reps 3, --profile: the
#                checkpoint written on the GPU (20-60 s, Fast-dLLM's code), then per mode a load
#                (9 s) and per batch a cold first decode (3 programs: 14 s at batch 1 before;
#                batch 16 and 32 never timed) and 4 more decodes (0.4 s at batch 1, 1.3 s at 8);
#                the second process's first decodes (unquantized) over its persistent cache.
#                Each profiled case's report gives its step time outside the kernels (and each
#                gpu_step.py case times the request's transfers as ten + four arrays against the
#                packed one + one). Since the last lease a step sends its request as one array
#                and reads its predictions as one; then, prefix b1 spent 1.76 ms of its 10.64 ms
#                mean step outside the kernels (gpu.md), and dual b1's mean step, 8.96 ms, was
#                about 0.9 ms over its isolated steps (8 refreshes at 13.34 ms, 30 steps at 6.66:
#                gpu_step.md).
#                About 400 s if a batch-32 program compiles in 40 s: the budget (260 s and up
#                after target, attncheck and decide, as they end early) cuts the int8 cases from the last batch
#                back: a second call with PARTS=dual DUAL_QUANTS=int8 measures them in the
#                decided form. Fast-dLLM's dual b1 and b8 are in gpu_parts/ (the merge pairs
#                them); its b16 and b32 are not timed.
#   tiered 180+60  benchmarks/first_decode.py --path engine --compile tiered, prefix cache, batch 1 (an
#                engine's first request, as Model.generate, the commands and the server run it; the first-decode
#                target's worst case: 142 s cold, gpu.md): the step programs compiled quick (no
#                autotuning, cuBLAS's GEMMs: for an H200 on 2 CPU cores 3.4-4.2 s a batch-1 prefix
#                program against Triton's 6.0-7.9, gpu_target_parts/h200_target_quick.md) first,
#                their full compiles (autotuned) built behind on one thread at the
#                lowest priority while the decode runs, and the steps of a window with no program yet
#                run padded in a wider window's compiled one (the read bucket in place: about 3 programs
#                waited for instead of 10) while theirs is built behind; then a second process over its persistent
#                cache (the full programs, by the first's markers). Its report: the first decode's
#                wait, the quick programs' second decode against the upgraded one's, the upgrades'
#                seconds, whether the tokens held (never run: the quick tier's compile seconds on a
#                GPU are the question; on 2 CPU cores tiered was no faster, first_decode_tiered.md).
#   probe  130  benchmarks/gpu_step.py, the 9 programs of a prefix-cache decode at batch 1 on
#                4 threads, no persistent cache: each program's compile s, first execution ms
#                and step ms (at the autotuner's choice of kernels); XLA writes its autotuning
#                results to autotune.pbtxt. Never run: 4 gpu_step programs compiled in
#                10-18 s each side by side, the decode's 9 in 54 s each (542 s on 4 threads).
#                Triton GEMMs off (cuBLAS) had halved the compiles of the dual and prefix steps
#                (and slowed them): the autotuner is the suspect.
#   probeload 90 the same, cold again, with XLA reading those results
#                (--xla_gpu_load_autotune_results_from): the compile a fresh process would see
#                if dlm-jax shipped the device's autotuning results; skipped without the file.
#   probe0  90  the same with XLA_FLAGS --xla_gpu_autotune_level=0 (no autotuning).
#   gemm    60  benchmarks/gemm_probe.py: one layer's q/k/v and gate/up GEMMs separate against
#                fused into one, unquantized and int8, at 32 and 256 rows (16 small programs):
#                whether fusing them at load, or int8, would shorten the step (never run).
#   fused   90  benchmarks/gpu_step.py --projections separate fused, batch 1 and 8, dual and
#                prefix, --profile: the executor's q/k/v and gate/up fused into one GEMM each
#                (dlm_jax.models._fuse) against separate, in one run, with each step's kernels.
#                The 4096-wide projections read their weights at 1.6-2.8 TB/s at batch 1, the
#                12288-wide ones at 3.5 (gpu_step.md). 8 programs, two sets of weights made.
#   attention 160 benchmarks/gpu_step.py --attention split cudnn cudnn_split pallas, batch 1 and 8,
#                refresh, dual and prefix (24 programs, a refresh reading no cache is cudnn's program
#                again under cudnn_split; about 95 s, then 10 timed steps each). The pallas form
#                (dlm_jax.models._attention_kernel: one Triton kernel a layer over the cache where it
#                lies and the window) compiled for an H200 here launches the fewest kernels and
#                writes the fewest bytes of the four (dual b1 537 kernels, 1.32 GB; dual b8 504,
#                4.30 GB; its kernel's own speed is this part's question). Compiled for an H200 here
#                (benchmarks/results/gpu_target.md), cuDNN's steps launch 30-38% fewer kernels
#                than the split ones (19-32% in a refresh), its refresh no [B, H, W, W] float32
#                scores; the split steps move less data at batch 8 (no copy of the cache), and
#                cudnn_split neither: 4.44 GB written at dual b8 against cudnn's 6.44, for 65
#                more kernels (33 at batch 1).
#   probekernel 130 the probe (no persistent cache, autotuning on) with --attention pallas: the
#                split form's score and value products are 4 of each program's 10 distinct GEMMs,
#                which the autotuner times one by one; the kernel's programs have 6
#                (benchmarks/results/gpu_target.md: 49.5 s of compiling without autotuning here,
#                against 57.3 s split, in one run). Whether that shortens the 142 s cold wait.
#   attngqa  90  benchmarks/gpu_step.py --shape gqa-8b --attention split pallas, batch 1, 8 and 32,
#                dual and prefix (12 programs): a grouped-query 8B model's steps, where the kernel's
#                programs take a K/V head's 4 query heads and read its cache once (the split form
#                broadcasts each K/V head to its query heads first: 950-1018 kernels a step against
#                the kernel's 504-537 compiled for an H200 here, gpu_target.md); batch 1 shows what
#                8 programs a layer (one per K/V head) cost in occupancy.
#   sweep   120  benchmarks/kernel_sweep.py --batches 1 32: one step's attention over 32 layers'
#                caches, dual and prefix, LLaDA-8B's and the grouped-query shape, the split form
#                against the kernel under 8 tilings (the default, then block_k 32 / 128, rows
#                halved, 8 / 4 warps, 2 / 4 stages), each against float32: the fastest tiling
#                within the margins, over the split form and the default (72 small programs;
#                compiled for an H200 here every tiling compiles, 1.2-2.2 s each without
#                autotuning: benchmarks/results/gpu_target_parts/h200_kernel_sweep.md; the split
#                form's, autotuned on the device, may take longer). Written case by case, LLaDA-8B's
#                first: a cut part keeps the cases it finished.
#   cmdbuf   45  the fused part's separate cases again with XLA_FLAGS
#                --xla_gpu_enable_command_buffer= (no CUDA graphs: every kernel launched on its
#                own), with their kernels: whether XLA's command buffers, which it records on a
#                program's first run and updates when its buffers move, account for the 0.73-0.79
#                ms of each isolated b1 step outside its kernels (gpu_step.md: 8.51 ms against
#                7.78 ms of kernels at prefix b1 split, 6.66 against 5.87 at dual).
#   table   400  benchmarks/gpu.py, both sides, batch 1 and 8, --quant none int8, --reps 3,
#                --profile; --budget-s = its limit - 55 (a case in flight when it ends, stopped by
#                gpu.py 30 s past its worker's deadline, and the report), of which --second-budget-s 30 for the
#                second dlm-jax process (first decodes over the persistent cache $WORK/xla) and
#                --peer-budget-s 125 for Fast-dLLM. Estimated: the checkpoint written with
#                Fast-dLLM's code, initialized on the GPU (`--init-device cuda`: on a CPU its init
#                alone takes about 35 ns a parameter on 2 cores, minutes for 8B) and saved, 16 GB
#                (never timed: allow 30-60 s; the report records write_seconds); Fast-dLLM's load 73 s,
#                then 8 + 6 + 13 + 12 s (prefix/dual b1, b8: first + 3 timed decodes); dlm-jax per
#                weight mode 10 s of load, 39 s at b1 and 85 s at b8 (cold compiles 36 s and 73 s),
#                each case + 1 profiled decode; the second process about 25 s. About 510 s in
#                all: the budget cuts dlm-jax's int8 cases at b8 (and at b1 if the compiles
#                are no faster than that).
#   small    50  benchmarks/gpu.py --small (the correctness half; tiny float32 twin; 20-40 s).
#   logits   30  benchmarks/logits_host.py: sampling, penalties, bias, logprobs and ISD's
#                acceptance at the 8B vocabulary, the host's float64 path against the GPU's
#                (`Proposer.logits_on`).
#   large   300  benchmarks/gpu.py --sides dlm_jax at batch 16 and 32, both caches, none and
#                int8, --reps 3, --profile, its own compilation cache (the prefix cache's there:
#                about 10 programs a batch, minutes cold); Fast-dLLM's side is not timed (its
#                load alone is 73 s).
#   probecache 150+60  the probe with the executor's persistent cache, then a second process
#                over it (loads, not compiles: a second process's first decode).
#   cacheload 75 benchmarks/cache_load.py over that cache, 1 process per variant: a second
#                process's wait per program split into trace, lower and load (deserialization),
#                with the blocks traced once (the executor's default) and one by one. On 2 CPU
#                cores the load was 0.65 of it at the 8B shape (benchmarks/results/cache_load.md).
#   probeserial 120  the probe on 1 thread (the autotuner alone on the device).
#   qsweep  160  benchmarks/quant_sweep.py --quant int4-g128 int8-g128 none: one layer's q / gate / down
#                kernels (8 copies each, out of the L2) at 32 and 256 rows, bfloat16, XLA's form of
#                the grouped product against dlm-jax's Pallas kernel under 9 tilings (the default,
#                whose split auto_split picks, 64 / 32 columns a program, the input rows summed
#                whole or split 2 / 4 / 8 ways, 64 columns split 4 ways, 8 warps): which tiling to
#                make the default, and whether the kernel beats XLA's form at all (132 small
#                programs; compiled for an H200 here, every tiling compiles in under a second:
#                benchmarks/results/gpu_target_parts/h200_quant_sweep.md). At 32 rows a layer's q
#                kernel in 128 columns a program is 32 programs for the GPU's 132
#                multiprocessors unless split: whether the splits pay for their partial sums.
#                none: the bfloat16 kernels in XLA's GEMM against the same kernel reading them as
#                they are (60 more programs): whether a weight-streaming kernel of dlm-jax's own
#                beats XLA's GEMMs at a batch-1 step's 32 rows (the bf16 steps ran at 28-41% of
#                the bandwidth; gpu_target_parts/h200_quant_sweep_bf16.md: XLA splits its 32-row
#                q GEMM 4 ways too). Written case by case, the q kernel's first.
#   int4    115  benchmarks/gpu_step.py --quant none none+dense int8 int4-g128 int4-g128+pallas
#                uint4-g128 uint4-g128+pallas, dual steps at batch 1 and 8 (14 programs, four sets of
#                weights made; none+dense: the bfloat16 step's dense products in dlm-jax's kernel,
#                reading the weights as they are, against XLA's GEMMs): whether int4 weights in
#                groups of 128 (the "-W4A16" releases' layout) halve int8's batch-1 step, as their
#                bytes would, and whether uint4's zero points (the "-AWQ" releases') cost anything
#                more (never run; compiled for an H200 here, the
#                grouped and uint4 steps write every kernel dequantised in bfloat16, 15.0 GB a step
#                more than int8, where per-channel int4's convert is fused:
#                benchmarks/results/gpu_target.md; the times say what that costs), in XLA's form
#                and in dlm-jax's Pallas kernel (dlm_jax.models._quant_kernel), which reads the
#                int4 weights two a byte and dequantises them inside the GEMM (no weight-sized
#                buffer when compiled for an H200; never timed).
#   qkernel  90  benchmarks/gpu_step.py --quant none int8 int8-g128 int8-g128+pallas fp8-g128
#                fp8-g128+pallas, dual steps at batch 1 and 8 (12 programs, four sets of weights): the
#                grouped products in XLA's form (each kernel written dequantised every step, compiled
#                for an H200 here) against dlm-jax's Pallas kernel that dequantises each group inside
#                the GEMM (dlm_jax.models._quant_kernel: no weight-sized buffer; never timed), with
#                per-channel int8 and bfloat16 beside them.
#   cudnn    40  benchmarks/gpu_step.py --attention cudnn, batch 1 and 8, dual and prefix.
#   scan     45  benchmarks/gpu_step.py --layers scan, batch 1 and 8, dual and prefix.
#   scandsf  40  the same, dual only, with XLA_FLAGS --xla_gpu_enable_dynamic_slice_fusion=true:
#                scanned steps ran 2-4x the unrolled ones (benchmarks/results/gpu_step_cudnn_scan.md),
#                about what copying each layer's weights out of the [L, ...] stack would add (a
#                dynamic slice a GEMM does not read in place); XLA's dynamic-slice fusion lets a
#                library GEMM read the slice where it lies. On this CPU the scanned step's HLO
#                has such a copy fusion per weight (a dynamic-slice fusion feeding each dot).
#                Not in the default parts: compiled for an H200 here, the scanned steps copy
#                every layer's weights out of the stack with the flag as without it (the same
#                kernels and bytes: 16.56 GB written at dual b1 against the unrolled 1.51;
#                benchmarks/results/gpu_target.md). PARTS=scandsf runs it.
#   first 60+60  benchmarks/first_decode.py --path engine (an engine's first request, its programs
#                handed to the 4 compile threads as it is admitted), prefix cache: cold, then a second process over its
#                cache (the dual cache's are in first_decode.json), which then decodes a
#                200-token prompt, a later request of another length: its new compiles (the
#                refresh's window; the cached steps' programs are the 128-token prompt's, as
#                the cache reads in place: JaxExecutor.read_bucket) and what it waits.
# Cut first when time runs short: the last parts, then inside a gpu.py part, by its budgets:
# dlm-jax's int8 cases (they follow all unquantized ones), Fast-dLLM's b8 (past
# --peer-budget-s), the second process's cases. Knobs: PARTS, LIMIT, DUAL_S, TABLE_S,
# LARGE_S, DUAL_BATCHES, DUAL_QUANTS, BATCHES, LARGE_BATCHES, QUANTS, PEER_S, SECOND_S,
# PROJECTIONS and ATTENTION (dlm-jax's in the gpu.py and first_decode.py parts; unset, the decide
# part chooses them, and without it the executor's defaults hold: separate, split; given, they
# hold and nothing is decided) (e.g.
# PARTS="table" QUANTS=int8 for a lease that measures only what an earlier one's budget cut,
# PARTS=dual DUAL_QUANTS=int8 DUAL_BATCHES="16 32" for the dual part's; a second call on a
# still-warm machine, its LIMIT the device time left less a minute (parts run in the script's
# order; the first call's choice comes back from $WORK/decided.env): PARTS=rest, every part the
# calls before it on this machine did not end with exit 0, in order ($WORK/parts.state,
# benchmarks/lease_rest.py), the dual part over the batches and quant modes its budget left
# (by gpu.py's report). A machine stays warm 30 s after a call, so the second call is this one
# command, its LIMIT the reply's budget_left_s less 60:
#   run(command="OUT=$OUT PARTS=rest LIMIT=L bash benchmarks/gpu_lease.sh", carry=[".peer"], timeout_s=L+40)
# (on a fresh machine instead, $WORK is empty: name the PARTS, and ATTENTION and PROJECTIONS as
# the first call's decide.md chose).
# (The device's compile-only config: cp $LEASE/target_config.txtpb benchmarks/targets/h200_device.txtpb.)
#
# After the lease, on this machine ($LEASE below: each call's archives unpacked, as above):
# copy gpu*.json into benchmarks/results/gpu_parts/ (named by device and content; a case in
# several parts takes each side from the first part named that measured it, so name the
# newest first), then (the first full-mode part gives the load times and devices):
#   P=benchmarks/results/gpu_parts   (the lease's parts present, newest first, then the earlier ones)
#   .venv/bin/python benchmarks/gpu.py --merge $LEASE/gpu_dual.json $LEASE/gpu.json $LEASE/gpu_large.json \
#     $P/h200_gpu_init_b1_b8.json $P/h200_gpu_init_dlm_jax_b1_b8.json $P/h200_small.json --out benchmarks/results/gpu
#   .venv/bin/python benchmarks/gpu_step.py --render $LEASE/probe_nocache.json $LEASE/probe_load.json $LEASE/probe_autotune0.json $LEASE/probe_kernel.json $LEASE/probe_cache.json $LEASE/probe_cache2.json $LEASE/probe_serial.json --out benchmarks/results/compile_probe
#   (and $LEASE/autotune.pbtxt into benchmarks/results/gpu_parts/, named by device and jaxlib)
#   cp $LEASE/cache_load.* benchmarks/results/gpu_parts/ (named by device; the CPU's are benchmarks/results/cache_load.*)
#   cp $LEASE/gemm_probe.json benchmarks/results/gpu_parts/h200_gemm_probe.json, its .md and .png into benchmarks/results/
#   cp $LEASE/attention_check.json benchmarks/results/gpu_parts/h200_attention_check.json, its .md to benchmarks/results/attention_check.md
#   cp $LEASE/decide.json benchmarks/results/gpu_parts/h200_decide.json, $LEASE/decide_steps.json to gpu_parts/h200_decide_steps.json,
#     $LEASE/decide.md to benchmarks/results/gpu_decide.md; then make the choice the executor's default on a GPU
#     (GPU_ATTENTION, GPU_PROJECTIONS in dlm_jax/executors/jax_executor.py) and say so in docs/architecture.md
#   cp $LEASE/kernel_sweep.json benchmarks/results/gpu_parts/h200_kernel_sweep.json, its .md and .png to benchmarks/results/kernel_sweep.*
#   cp $LEASE/quant_sweep.json benchmarks/results/gpu_parts/h200_quant_sweep.json, its .md and .png to benchmarks/results/quant_sweep.*;
#     then make its fastest tiling _quant_kernel.DEFAULT_TILING (and the kernel the GPU's default where it beats XLA's form)
#   .venv/bin/python benchmarks/gpu_step.py --render $LEASE/fused.json $LEASE/cmdbuf_off.json --out benchmarks/results/gpu_step_fused
#   .venv/bin/python benchmarks/gpu_step.py --render $LEASE/attention.json $LEASE/attention_gqa.json $LEASE/cudnn.json $LEASE/scan.json $LEASE/scan_dsf.json $LEASE/int4.json $LEASE/qkernel.json --out benchmarks/results/gpu_step_lease
#   .venv/bin/python benchmarks/first_decode.py --render benchmarks/results/first_decode.json \
#     $LEASE/first_decode.json --out benchmarks/results/first_decode
#   .venv/bin/python benchmarks/first_decode.py --render benchmarks/results/first_decode_tiered.json \
#     $LEASE/first_tiered.json --out benchmarks/results/first_decode_tiered
#   cp $LEASE/logits_gpu.json $LEASE/logits_gpu.md benchmarks/results/ (the proposer's rules on the GPU; if the
#     device path is the faster there, as it should be, `logits_on="auto"` already picks it on a GPU)
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:?set OUT to the folder that comes back}
PY=${PY:-python3}             # the GPU machine's python3 holds JAX with its CUDA plugin
LIMIT=${LIMIT:-470}           # the whole script's wall-clock seconds
WORK=${WORK:-/tmp/dlm-jax-lease}  # checkpoint and compilation caches (large: not under $OUT)
PEER=${PEER:-.peer/Fast-dLLM}
BATCHES=${BATCHES:-1 8} LARGE_BATCHES=${LARGE_BATCHES:-16 32} QUANTS=${QUANTS:-none int8}
DUAL_LEFT=${DUAL_BATCHES:+given}${DUAL_QUANTS:+given}  # (given: PARTS=rest keeps them)
DUAL_GIVEN=${DUAL_BATCHES:+given}  # (a choice other than the defaults reorders them, unless given)
DUAL_BATCHES=${DUAL_BATCHES:-1 16 32 8} DUAL_QUANTS=${DUAL_QUANTS:-none int8}
TABLE_S=${TABLE_S:-400} LARGE_S=${LARGE_S:-300} PEER_S=${PEER_S:-125} SECOND_S=${SECOND_S:-30} DUAL_S=${DUAL_S:-330}
# The parts this lease runs, in this order's priority (the table's both sides were measured on
# 2026-11-28: benchmarks/results/gpu_parts/); e.g. PARTS="table small" for the table alone.
DEFAULT_PARTS="target attncheck decide dual tiered probe fused cmdbuf probeload probe0 gemm attention probekernel attngqa sweep table small logits large probecache cacheload probeserial qsweep int4 qkernel cudnn scan first"
PARTS=${PARTS:-$DEFAULT_PARTS}    # or rest: what the calls before this one on this machine left
MARGIN_S=55                   # of a gpu.py part's limit, not in its --budget-s
SHAPE=llada-8b GPU_X=() STEP_X=() FIRST_X=() GEMM_X=() CACHE_X=() CHECK_X=() SWEEP_X=() LOGITS_X=(--repeats 3)
QSWEEP_X=(--tilings default n64 n32 split1 split2 split4 split8 n64split4 warps8)
if [ -n "${DRY:-}" ]; then  # a CPU: the tiny float32 twin, small batches, the same code paths
  SHAPE=small BATCHES=1 LARGE_BATCHES=2 DUAL_BATCHES="1 2"
  GPU_X=(--shape small --dtype float32 --prompt-len 32 --gen-len 64)
  STEP_X=(--shape small --dtype float32 --reps 2) FIRST_X=(--shape small --dtype float32)
  GEMM_X=(--shape small --dtype float32) CACHE_X=(--shape small --dtype float32) LOGITS_X=(--vocab 4096 --repeats 3)
  CHECK_X=(--shape small --stand-in)  # (a CPU has no cuDNN: JAX's XLA attention in its place)
  SWEEP_X=(--shape small --stand-in --layers 2 --tilings default k32)  # (the interpreter ignores warps, stages)
  QSWEEP_X=(--shape small --stand-in --layers 2 --rows 8 --calls 2 --reps 2 --tilings default split4)
  # One thread per process: torch's OpenMP threads spin against whatever else shares the CPU
  # (their tiny decodes went from 0.05 s to 2-7 s on two shared cores).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
rm -rf "$WORK/xla" "$WORK/xla-large" "$WORK/xla-first" "$WORK/xla-probe" "$WORK/xla-dual" "$WORK/xla-tiered"  # measured cold
mkdir -p "$OUT" "$WORK"
RES=${RES:-$(mktemp -d "$WORK/out.XXXXXX")}  # the parts' results (a new folder a call), packed into $OUT
mkdir -p "$RES"
log=$OUT/log.txt
# Every part's outcome, every call's (`CALL PART ok|fail|skip|cut`), for a later call's PARTS=rest.
STATE=$WORK/parts.state
CALL=$(( $(awk 'END { print $1 + 0 }' "$STATE" 2>/dev/null || echo 0) + 1 ))
# What comes back from a call is at most 8 files of at most 16 MiB each (the device tool): the
# parts write some 90 files, so after each part the results are packed, as they stand, into
# lease.tar.gz (the reports: JSON, Markdown, text) and lease_extra.tar.gz (plots, gpu.py's worker
# files, XLA's autotuning results: the large ones, so that they never hold the reports back);
# each written beside and renamed into place, so a call cut while packing keeps the last pack.
EXTRA=(-name '*.png' -o -name autotune.pbtxt -o -path './*_work/*')
pack() {
  local a=$OUT/lease.tar.gz b=$OUT/lease_extra.tar.gz
  (cd "$RES" && find . -type f ! -name '*.tmp' ! -name '.*.tmp-*' ! \( "${EXTRA[@]}" \) -print0 | tar -czf "$a.part" --null -T - \
    && mv -f "$a.part" "$a") >> "$log" 2>&1
  (cd "$RES" && find . -type f ! -name '*.tmp' ! -name '.*.tmp-*' \( "${EXTRA[@]}" \) -print0 | tar -czf "$b.part" --null -T - \
    && mv -f "$b.part" "$b") >> "$log" 2>&1
}
start=$SECONDS
# cap LIMIT: LIMIT cut to the time left less 10 s (the kill's 5 s grace and what follows).
cap() { local room=$(( LIMIT - (SECONDS - start) - 10 )); echo $(( $1 < room ? $1 : room )); }
# part NAME LIMIT MIN CMD...: CMD under `timeout` (its whole process group) for `cap LIMIT` s;
# skipped when that is under MIN s.
part() {
  local name=$1 limit min=$3 t0=$SECONDS rc; limit=$(cap "$2"); shift 3
  if (( limit < min )); then skipped "$name" "$limit s left (needs $min)"; return 0; fi
  echo "$name: limit $limit s: $*" >> "$log"
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$log"
  echo "$CALL $CUR $([ $rc = 0 ] && echo ok || echo fail)" >> "$STATE"
  [ $rc = 0 ] && ENDED_OK[$name]=1
  pack
}
declare -A ENDED_OK=()  # the parts of this call that ended with exit 0, by name
# skipped NAME WHY: part NAME not run, said in the log and recorded for a later PARTS=rest.
skipped() { echo "$1: skipped, $2" | tee -a "$log"; echo "$CALL $CUR skip" >> "$STATE"; }
# needs FIRST NAME: whether part NAME, a second process over the cache part FIRST filled in this
# call, runs: only after FIRST ended with exit 0 (over an empty or half-filled cache it would time
# compiles under the cache's label); else NAME is recorded skipped.
needs() {
  [ -n "${ENDED_OK[$1]:-}" ] && return 0
  skipped "$2" "$1 did not end with exit 0 in this call"; return 1
}
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv || true; } > "$RES/smi.txt" 2>&1
[ -f "$PEER/llada/generate.py" ] || echo "no Fast-dLLM sources in $PEER: run benchmarks/peer_src.sh and carry .peer" | tee -a "$log"

# want PART: whether this call runs it (and the part whose outcome `part` records, CUR).
want() { [[ " $PARTS " == *" $1 "* ]] && CUR=$1; }
if [ "$PARTS" = rest ]; then
  # shellcheck disable=SC2086
  PARTS=$($PY benchmarks/lease_rest.py parts "$STATE" $DEFAULT_PARTS)
  # cache load reads the cache the probe cache part fills, in the same call (every call starts cold)
  [[ " $PARTS " == *" cacheload "* && " $PARTS " != *" probecache "* ]] && PARTS=${PARTS/cacheload/probecache cacheload}
  echo "rest: ${PARTS:-nothing left}" | tee -a "$log"
  if [ -s "$WORK/dual_rest.env" ] && [ -z "$DUAL_LEFT" ] && want dual; then
    . "$WORK/dual_rest.env" && DUAL_GIVEN=given  # (only what an earlier call's budget cut)
    echo "rest: dual over DUAL_BATCHES=\"$DUAL_BATCHES\" DUAL_QUANTS=\"$DUAL_QUANTS\"" | tee -a "$log"
  fi
fi
G=benchmarks/gpu.py S=benchmarks/gpu_step.py F=benchmarks/first_decode.py
want target && part target 20 10 $PY $S --write-target --out "$RES/target_config"
# The attention forms against float32 on the device (cudnn_split's merge of cuDNN's log-sum-exps
# and the Triton kernel checked before they are timed or chosen).
want attncheck && part attncheck 60 15 $PY benchmarks/attention_check.py "${CHECK_X[@]}" --out "$RES/attention_check"
# The GPU's attention form and projections, decided before the table's parts measure anything:
# the split form and the kernel over separate and fused projections, timed in one run, then
# gpu_decide.py's choice (a form the check did not pass is never chosen) for every gpu.py and
# first_decode.py part after it, unless ATTENTION or PROJECTIONS were given. A later call on the
# same machine takes the choice again from $WORK/decided.env.
DECIDED=$WORK/decided.env
if [ -z "${ATTENTION:-}${PROJECTIONS:-}" ] && want decide; then
  part decide 120 45 $PY $S --batches 1 8 --kinds dual --attention split pallas --projections separate fused \
    --reps 10 "${STEP_X[@]}" --out "$RES/decide_steps"
  choice=$($PY benchmarks/gpu_decide.py --steps "$RES/decide_steps.json" --check "$RES/attention_check.json" \
    --out "$RES/decide" 2>> "$log")
  [[ $choice =~ ^ATTENTION=[a-z_]+\ PROJECTIONS=[a-z]+$ ]] && echo "$choice" > "$DECIDED"
  echo "decide: ${choice:-nothing decided (the executor defaults kept)}" | tee -a "$log"
elif [ -z "${ATTENTION:-}${PROJECTIONS:-}" ] && [ -s "$DECIDED" ]; then
  choice=$(cat "$DECIDED")
  echo "decide: $choice (an earlier call's, $DECIDED)" | tee -a "$log"
fi
if [[ ${choice:-} =~ ^ATTENTION=([a-z_]+)\ PROJECTIONS=([a-z]+)$ ]]; then
  ATTENTION=${BASH_REMATCH[1]} PROJECTIONS=${BASH_REMATCH[2]}
  # Batch 1 and 8 of the table were measured in the defaults' form (split, separate): in another
  # form they come first again, being the issue's targets (ascending: the budget cuts 32 first).
  if [ "$ATTENTION/$PROJECTIONS" != split/separate ] && [ -z "$DUAL_GIVEN" ]; then
    DUAL_BATCHES=$(tr ' ' '\n' <<< "$DUAL_BATCHES" | sort -n | tr '\n' ' ')
  fi
fi
ALL=(--peer-src "$PEER" --checkpoint "$WORK/ckpt-$SHAPE" --reps 3 --profile "${GPU_X[@]}")
CHOSEN=()  # (first_decode.py's)
[ -n "${PROJECTIONS:-}" ] && ALL+=(--projections "$PROJECTIONS") && CHOSEN+=(--projections "$PROJECTIONS")
[ -n "${ATTENTION:-}" ] && ALL+=(--attention "$ATTENTION") && CHOSEN+=(--attention "$ATTENTION")
# dlm-jax's dual-cache decodes, unquantized and int8, at batch 1, 16, 32 and 8: what the table
# lacked (its 3 programs a batch compile in seconds; the prefix cache's 9 took minutes).
t=$(cap "$DUAL_S")
# shellcheck disable=SC2086  # DUAL_BATCHES and DUAL_QUANTS are lists of words
want dual && part dual "$t" 60 $PY $G "${ALL[@]}" --sides dlm_jax --caches dual --quant $DUAL_QUANTS \
  --batches $DUAL_BATCHES --xla-cache "$WORK/xla-dual" --work "$RES/gpu_dual_work" --budget-s $(( t - MARGIN_S )) \
  --second-budget-s "$SECOND_S" --out "$RES/gpu_dual"
# The cases its budget left (by its report), for a later call's PARTS=rest.
if want dual && [ -s "$RES/gpu_dual.json" ]; then
  left=$($PY benchmarks/lease_rest.py unmeasured "$RES/gpu_dual.json" 2>> "$log")
  if [ -n "$left" ]; then
    echo "$left" > "$WORK/dual_rest.env" && echo "$CALL dual cut" >> "$STATE"
    echo "dual: left for PARTS=rest: $left" | tee -a "$log"
  else
    rm -f "$WORK/dual_rest.env"
  fi
fi
# A tiered compile's first decode (quick programs, full ones built behind), then a second process.
t=$(cap 180)
want tiered && part "tiered cold" "$t" 60 $PY $F --path engine --cache prefix --compile tiered --xla-cache "$WORK/xla-tiered" \
  --upgrade-wait-s $(( t > 100 ? t - 70 : 30 )) --label "tiered cold" "${FIRST_X[@]}" "${CHOSEN[@]}" --out "$RES/first_tiered"
want tiered && needs "tiered cold" "tiered cache" && part "tiered cache" 60 15 $PY $F --path engine --cache prefix --compile tiered \
  --xla-cache "$WORK/xla-tiered" --upgrade-wait-s 20 --label "tiered cache" "${FIRST_X[@]}" "${CHOSEN[@]}" \
  --out "$RES/first_tiered"
# The compile probe: every program of a prefix-cache first decode at batch 1 (9), on the
# executor's 4 compile threads, timed program by program: without a persistent cache, without
# XLA's autotuning, with the persistent cache as the executor enables it (XLA's per-fusion
# autotuning cache under it), and on one thread (autotuning alone on the device). A cold decode waited 142 s for them where one lease before it had waited
# 36 s (benchmarks/results/gpu.md); the probe tells the cache, the autotuner and the programs
# apart.
PROBE=(--batches 1 --kinds refresh prefix --at 0 1 2 3 4 5 6 7 --reps 3 "${STEP_X[@]}")
TUNED=$WORK/autotune.pbtxt  # XLA's autotuning results of the probe's programs (text proto; a later call reads them)
want probe && part "probe" 130 40 env XLA_FLAGS=--xla_gpu_dump_autotune_results_to=$TUNED \
  $PY $S "${PROBE[@]}" --threads 4 --out "$RES/probe_nocache"
want probe && [ -s "$TUNED" ] && cp "$TUNED" "$RES/" && pack
# Fused projections against separate ones, in one run, with their kernels.
want fused && part fused 90 40 $PY $S --batches 1 8 --kinds dual prefix --projections separate fused --reps 10 \
  --profile "${STEP_X[@]}" --out "$RES/fused"
# The same without command buffers (CUDA graphs), for the time a step spends outside its kernels.
want cmdbuf && part "command buffers off" 45 25 env XLA_FLAGS=--xla_gpu_enable_command_buffer= \
  $PY $S --batches 1 8 --kinds dual prefix --reps 10 --profile "${STEP_X[@]}" --out "$RES/cmdbuf_off"
if want probeload && [ ! -s "$TUNED" ]; then
  skipped "probe load" "no autotuning results in $TUNED"
elif want probeload; then
  part "probe load" 90 30 env XLA_FLAGS=--xla_gpu_load_autotune_results_from=$TUNED \
    $PY $S "${PROBE[@]}" --threads 4 --out "$RES/probe_load"
fi
want probe0 && part "probe no autotuning" 90 30 env XLA_FLAGS=--xla_gpu_autotune_level=0 \
  $PY $S "${PROBE[@]}" --threads 4 --out "$RES/probe_autotune0"
want gemm && part gemm 60 20 $PY benchmarks/gemm_probe.py "${GEMM_X[@]}" --out "$RES/gemm_probe"
# The in-place (split), cuDNN (over a copy and in place) and Pallas attention in one run (two
# leases gave split and cudnn apart).
want attention && part attention 160 40 $PY $S --batches 1 8 --kinds refresh dual prefix \
  --attention split cudnn cudnn_split pallas --reps 10 "${STEP_X[@]}" --out "$RES/attention"
# The probe's programs in the kernel's form: 6 distinct GEMMs a program for the autotuner, not 10.
want probekernel && part "probe kernel" 130 40 $PY $S "${PROBE[@]}" --attention pallas --threads 4 \
  --out "$RES/probe_kernel"
# A grouped-query 8B model's steps (the kernel reads each K/V head's cache once for its 4 query
# heads); DRY's STEP_X puts the tiny shape back.
want attngqa && part "attention gqa" 90 30 $PY $S --shape gqa-8b --batches 1 8 32 --kinds dual prefix \
  --attention split pallas --reps 10 "${STEP_X[@]}" --out "$RES/attention_gqa"
# The kernel's tilings, timed one step's attention at a time, each against float32.
want sweep && part sweep 120 40 $PY benchmarks/kernel_sweep.py --batches 1 32 "${SWEEP_X[@]}" --out "$RES/kernel_sweep"
t=$(cap "$TABLE_S")  # its budget ends MARGIN_S before its timeout, however far the part was cut
# shellcheck disable=SC2086
want table && part table "$t" 60 $PY $G "${ALL[@]}" --quant $QUANTS --batches $BATCHES --xla-cache "$WORK/xla" \
  --work "$RES/gpu_work" --budget-s $(( t - MARGIN_S )) --peer-budget-s "$PEER_S" --second-budget-s "$SECOND_S" \
  --out "$RES/gpu"
want small && part small 50 30 $PY $G --small --peer-src "$PEER" --checkpoint "$WORK/ckpt-small-twin" \
  --out "$RES/gpu_small"
# The proposer's rules over a step's logits at LLaDA-8B's vocabulary: the host's float64 path
# against the same rules beside the logits on the GPU (`Proposer.logits_on`), one request's
# 32 rows; 120 ms sampling and 70-75 ms penalties / bias / 32 logprobs on this CPU's host path
# (benchmarks/results/logits_host.md), never timed on a GPU.
want logits && part logits 30 15 $PY benchmarks/logits_host.py "${LOGITS_X[@]}" --out "$RES/logits_gpu"
t=$(cap "$LARGE_S")
# shellcheck disable=SC2086
want large && part large "$t" 60 $PY $G "${ALL[@]}" --quant $QUANTS --sides dlm_jax --batches $LARGE_BATCHES \
  --xla-cache "$WORK/xla-large" --work "$RES/gpu_large_work" --budget-s $(( t - MARGIN_S )) \
  --second-budget-s "$SECOND_S" --out "$RES/gpu_large"
want probecache && part "probe cache" 150 40 $PY $S "${PROBE[@]}" --threads 4 --xla-cache "$WORK/xla-probe" \
  --out "$RES/probe_cache"
# A second process over that cache: each program loaded instead of compiled, and its first
# execution (kernels loaded, command buffers recorded): a second process's first decode.
want probecache && needs "probe cache" "probe cache again" && part "probe cache again" 60 30 $PY $S "${PROBE[@]}" --threads 4 --xla-cache "$WORK/xla-probe" \
  --out "$RES/probe_cache2"
want cacheload && needs "probe cache" "cache load" && part "cache load" 75 30 $PY benchmarks/cache_load.py --kinds refresh prefix --at 0 1 2 3 4 5 6 7 \
  --repeats 1 --xla-cache "$WORK/xla-probe" "${CACHE_X[@]}" --out "$RES/cache_load"
want probeserial && part "probe serial" 120 40 $PY $S "${PROBE[@]}" --threads 1 --out "$RES/probe_serial"
want qsweep && part qsweep 160 30 $PY benchmarks/quant_sweep.py --quant int4-g128 int8-g128 none "${QSWEEP_X[@]}" \
  --out "$RES/quant_sweep"
want int4 && part int4 115 30 $PY $S --batches 1 8 --kinds dual --quant none none+dense int8 int4-g128 \
  int4-g128+pallas uint4-g128 uint4-g128+pallas --reps 10 "${STEP_X[@]}" --out "$RES/int4"
want qkernel && part qkernel 90 30 $PY $S --batches 1 8 --kinds dual --quant none int8 int8-g128 int8-g128+pallas \
  fp8-g128 fp8-g128+pallas --reps 10 "${STEP_X[@]}" --out "$RES/qkernel"
want cudnn && part cudnn 40 25 $PY $S --batches 1 8 --kinds dual prefix --attention cudnn --reps 10 "${STEP_X[@]}" \
  --out "$RES/cudnn"
want scan && part scan 45 25 $PY $S --batches 1 8 --kinds dual prefix --layers scan --reps 10 "${STEP_X[@]}" \
  --out "$RES/scan"
want scandsf && part "scan dsf" 40 25 env XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true \
  $PY $S --batches 1 8 --kinds dual --layers scan --reps 10 "${STEP_X[@]}" --out "$RES/scan_dsf"
want first && part "first cold" 60 40 $PY $F --path engine --cache prefix --xla-cache "$WORK/xla-first" --label cold \
  "${FIRST_X[@]}" "${CHOSEN[@]}" --out "$RES/first_decode"
want first && needs "first cold" "first cache" && part "first cache" 60 15 $PY $F --path engine --cache prefix --xla-cache "$WORK/xla-first" --label cache \
  --prompt-lens 200 "${FIRST_X[@]}" "${CHOSEN[@]}" --out "$RES/first_decode"
rm -f "$RES"/*.tmp
pack
echo "done in $((SECONDS - start)) s; results in $OUT/lease.tar.gz and lease_extra.tar.gz (from $RES)" | tee -a "$log"
grep -E "^(dual|probe|fused|gemm|attncheck|attention|table|small|large|cudnn|scan|first)|wrote|FAIL|PASS|first_decode_seconds" "$log" \
  | tail -40 || true
