#!/usr/bin/env bash
# Run memfit's GPU benchmarks in one go, in the order of RUNS below, each under its own time limit,
# writing results and logs to OUT (default benchmarks/results). Usage on a CUDA machine:
#   OUT=/some/dir bash benchmarks/gpu_runs.sh [name ...]      # names: see RUNS below
# Competitor and bitsandbytes wheels, when needed, must already be importable (PYTHONPATH).
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-benchmarks/results}    # the probes below read it from the environment
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
# name|seconds|command, the BLR runs to repeat after a kernel change first. blr_layers_monarch_decode times
# Monarch's decode (N = 1, 16) on every shape into its own folder (blr_layers_monarch also writes
# blr_layers_subset.json); at 8632dd8 it took 171 s of wall time, its file records 164 s. At d281e41 the layer table's first call
# stopped at its time limit after 22 cases and --resume timed the other 13 in a second call (the file records 814 s,
# its resumed cases 274.3 s); blr_layers --profile-only records 19.7 s. At 7eeb2bd the models of blr_e2e_memfit_attention record 215.9 s of set-up and timing, blr_counters took
# 72 s (its log's real time) and blr_layers --tokens 1 --structures blast records 72.9 s. The
# layer table needs two calls (as at 1476f91 and f969028): at af7a5bc, where the chained pipelines time every pair of
# their tiles, its file records 779 s, 372.1 s of case times for the 13 cases of a first call stopped at its limit and
# 386.5 s for the 22 blr_layers_resume timed (f969028's first call timed 30 cases in 579.7 s of case times).
# chain_tiles records 72 s at af7a5bc, 75 s at 34f6713, 83.5 s at 491a2d6. At cd59de1 the models of
# blr_e2e_memfit_attention, run first, record 276.9 s of set-up and timing (their tile and variant picks included),
# then blr_e2e's 194.5 s; pick_cost stopped after 41 of its 42 first calls (earlier/pick_cost_stopped_cd59de1.json).
# At 97ff95e, with the fused-SwiGLU row added, the full fine-tuning table, run under `timeout 400` in a device call
# of its own (its entry here then gave it 450 s), stopped after 75 of its 80 rows (394.6 s recorded; the bf16 SwiGLU
# row's five contexts left): its entry's limit is now 540 s. benchmarks/swiglu.py took 15 s.
# The full fine-tuning table took 335 s at 869ff01 (over 320 s at 141a414, before the subset row stopped
# recompiling every step); the ledger's 24 accuracy jobs record their own times, 74 s together at 141a414
# (ledger_accuracy.json, the models' set-up not included).
# At 1476f91 (the figures its result files and logs, some now in earlier/, record): the full layer table stopped at
# its 590 s limit with three cases left (Llama-7B down, N >= 128; its log ends there) and blr_layers_resume timed them; the file records
# 627 s, 495 s to build, check, tune and pick and 129 s to time. blr_layers_profile's file records 9 s, run on the
# machine the table had just used. The models of blr_e2e record 281 s of set-up and timing, those of
# blr_e2e_memfit_attention 166 s (each call also starts CUDA and measures the ceilings; 264 s at 1deb9e7).
# ledger_accuracy_blr's 11 jobs record 219 s at 6671149 (228 s at 074d5b1); at 91cd3b9 ledger_accuracy and
# ledger_accuracy_blr took 313 s of wall time together, in one device call. pick_cost's 42 first calls took 107 s at
# 11b0a19, 92.3 s at d1edfef, 142.5 s at af7a5bc, 179.2 s at 491a2d6, 177.1 s at 83e4b53 (give it 240 s); partial_ffn
# 115 s at 0a7cc7e, 128.5 s at 83e4b53.
# plan_fits (bitsandbytes needed: its 8-bit and 4-bit plans) ran 10 of its 17 plans at d2e16e1 before its call's limit,
# the plans' times in its file 337 s together (a 4-bit plan builds its model on the CPU: 58-120 s), and reached 14 at
# 027117b (13 ran, a partial-FFN plan is not built; 459 s of plan times in its file); plan_fits_resume measures the rest.
# The Monarch-only table at 412d845 records 490 s; its first call, under `timeout 430`, stopped after 27 of its 35 cases.
# At 0888d75 the full table records 851 s: a first call timed 14 cases, blr_layers_resume the other 21 (their case
# times 405.3 s); the models of blr_e2e --profile record 246.8 s of set-up and timing. The kernel tests there: the BLR file
# 79.65 s (log gpu_tests_blr_0888d75.log); the other four files together under -n 12, 354.4 s, where 11 of
# test_linear_ce's tests passed the 100 s limit, two of them inside the autotuner's compiles and nine inside a
# backward whose kernels autotune on first call, so that file has its own entry with a longer limit (log
# gpu_tests_other_0888d75.log). At c34cdd3 that file alone took 403.7 s under -n 12 (410 s of wall time; 119 passed,
# 13 skipped), near its 420 s limit, now 540; the BLR file 82.4 s (311 passed, 12 skipped; logs in results/logs). At
# ad67b83 the other three files 69.0 s (145 passed, 2 skipped). At 376884c (one device call, 166 s of wall time) the
# BLR file 84.2 s (322 passed, 12 skipped), the other three 69.3 s (152 passed, 2 skipped).
# The kernel tests on the GPU at 7d90041 (their logs in results/logs): 40.3 s for the BLR file, 275.6 s for 267 of the
# other files' 279 tests, stopped by a 270 s limit,
# each log's own count (-vv names every test as it ends, so a run stopped by its limit still says what it ran).
# blr_layers_decode_gemv (one token, Monarch and BLAST, every shape) took 199 s of wall time at 42ef66a, its file
# records 191 s (results/blr_layers_subset_decode_gemv.json). At 44a54ef blr_e2e_memfit_attention took 274 s of wall time
# on a machine just started, then blr_e2e 182 s on the same machine, warm (one device call each). At 62f9d18 three
# blr_layers processes at Llama-1B q/o and down, Monarch, N = 1, each with its own MEMFIT_AUTOTUNE_CACHE, took 81 s of
# wall time together on a machine just started (results/blr_layers_subset_decode_gemv_repeat*.json).
# gpu_tests_rest runs every other test file under a CUDA default device: code that makes a tensor without naming
# the device it needs (a pinned host buffer, a CPU generator's permutation) fails there and nowhere on the CPU.
# At bf0748c it took 83.2 s (99 failed, 533 passed, 22 errors: most the tests' own CPU assumptions, fixed or marked
# cpu_only since); at d3712f4 327.7 s (21 failed, 622 passed, 24 skipped; two tests stopped at the 200 s per-test
# limit), logs gpu_tests_rest_*.log; at 0b1eb37 285.6 s (2 failed, 615 passed, 51 skipped; on a machine whose caches
# a solo run of the two slow tests had just filled); at 9c13911 288.4 s on a machine just started (628 passed, 51
# skipped); at 4459d84 266.4 s, warm (631 passed, 51 skipped); at dbf0189 173.9 s on a machine just started (3
# failed, 663 passed, 51 skipped: test_adapter compared across devices, fixed in a0c7843, whose files took 58.4 s
# alone, gpu_tests_adapter_a0c7843.log). test_linear_ce at 031b9b9 took 168.2 s under -n 12.
# At 4dc1da1 the default 300-step BLAST compress of the 1B preset (compress_memory_blast300) took 425.3 s on an H100
# (430 s of wall time), blast_step_time 137 s of wall time together with test_compress.py on the GPU.
# tests/test_queued_timing.py runs alone (gpu_tests_timing): it times the GPU, which other test processes would share.
# At a77f798 blr_generate's file records 239 s (229 s at dfd69a8); gpu_tests_timing's log 1.8 s at 54fbce2.
# At 6a23ce9 the BLR file took 79.9 s (324 passed; the one failure, the pick memo's CPU stand-in made on the default
# CUDA device, fixed since); test_blr_compile.py 35.4 s under -n 4: its 10 op-level tests passed, its 10 model-level
# ones failed on a model built on the CPU and are marked cpu_only since (logs gpu_tests_blr*_6a23ce9.log). At 211e095
# the BLR file took 85.2 s (326 passed, 12 skipped) and test_blr_compile.py 30.3 s (10 passed, 10 skipped; 29.9 s at
# 2f772b1). gpu_tests_swiglu's log records 18.5 s at 57f53fe (34 passed), 22.5 s at 732a4bd (40 passed).
# At 685f2f3 blr_generate stopped at its 400 s limit before its BLAST case (its first case logged at 203 s, Monarch's
# at 312 s, 103 s after the one before, against 28 s at dfd69a8, whose machine had made some of its picks in an
# earlier call; the file records 311.8 s) on a fresh machine: its limit is now 560 s.
# At 31241dc the BLR file took 100.8 s (327 passed, 12 skipped), near its 120 s limit, now 180.
# At 5096b89 (tree 2f2ff72, its kernels 5096b89's) the BLR file with the tangent and second-order tests took 94.9 s
# (379 passed, 12 skipped), the other four 110.8 s (215 passed, 6 skipped; the attention fixes), test_blr_compile.py
# 31.6 s (10 passed, 10 skipped), test_swiglu.py 24.0 s (41 passed): one device call, 313.6 s of wall time.
# At f2dc988 test_blr_compile.py took 38.1 s (10 passed, 10 skipped); in the same call, outside this list, the autocast,
# multiple-of-8 and chunked-prefill tests of test_blr_layers.py and test_generate_chunked_prefill.py 77.7 s under
# MEMFIT_TEST_DEVICE=cuda (14 passed, 1 skipped) and test_compress.py's GPU-memory, resume and calibration tests 41.4 s
# (6 passed; logs gpu_tests_*_f2dc988.log).
# At af4fc90, on an H100: prefill_chunks 41 s of wall time, monarch_refine_time 19 s, compress_memory's lowrank-aware
# case alone 134 s (126.6 s in its file); the generate chunked-prefill tests under MEMFIT_TEST_DEVICE=cuda did not all
# finish in 110 s (their Generators compile on CUDA: logs gpu_tests_*_af4fc90.log). At d98126e, on an H100,
# gpu_tests_rest took 307.5 s (954 passed, 64 skipped, 6 failed: two truncated_svd tests drew with a CPU generator,
# fixed in 17a9f8e; log gpu_tests_rest_d98126e.log); compress_memory's lowrank-aware and blast cases under cProfile
# 167 and 225 s (one process each; /usr/bin/time in logs compress_memory_*_d98126e.log). At c472047 the
# compress tests of this session's changes under MEMFIT_TEST_DEVICE=cuda took 35.2 s (12 passed, the GPU compress
# tests among them) and the truncated-SVD, fused-loss and half-precision head tests 57.6 s (12 passed; logs
# gpu_tests_compress_c472047.log, gpu_tests_finetune_c472047.log).
RUNS=(
  "blr_layers|590|python3 benchmarks/blr_layers.py --out $OUT"
  "blr_layers_resume|590|python3 benchmarks/blr_layers.py --out $OUT --resume"
  "blr_e2e|400|python3 benchmarks/blr_e2e.py --out $OUT --profile"
  "blr_layers_monarch_decode|400|python3 benchmarks/blr_layers.py --out $OUT/monarch_decode --structures monarch --tokens 1 16"
  "blr_layers_decode_gemv|300|python3 benchmarks/blr_layers.py --out $OUT/decode_gemv --structures monarch blast --tokens 1"
  "blr_layers_monarch|590|python3 benchmarks/blr_layers.py --out $OUT --structures monarch"
  "blr_layers_monarch_resume|590|python3 benchmarks/blr_layers.py --out $OUT --structures monarch --resume"
  "blr_layers_profile|240|python3 benchmarks/blr_layers.py --out $OUT --profile-only"
  "decode_profile|240|python3 benchmarks/decode_profile.py --out $OUT"
  "blr_e2e_memfit_attention|400|python3 benchmarks/blr_e2e.py --out $OUT --profile --no-eager --attention memfit"
  "blr_e2e_memfit_attention_inductor_pdl|400|python3 benchmarks/blr_e2e.py --out $OUT --profile --no-eager --attention memfit --inductor-pdl"
  "blr_e2e_memfit_attention_decode_gemv|400|python3 benchmarks/blr_e2e.py --out $OUT --profile --no-eager --attention memfit --decode-gemv"
  "blr_generate|560|python3 benchmarks/blr_generate.py --out $OUT"
  "partial_ffn|300|python3 benchmarks/partial_ffn.py --out $OUT --skip-accuracy"
  "train_small_model|130|python3 benchmarks/train_small_model.py --out /tmp/small_llama --results $OUT --max-seconds 80"
  "partial_ffn_accuracy|150|python3 benchmarks/partial_ffn.py --out $OUT --skip-speed --small-model /tmp/small_llama"
  "linear_ce|330|python3 benchmarks/linear_ce.py --out $OUT"
  "blr_accuracy|300|python3 benchmarks/blr_accuracy.py --model /tmp/small_llama --out $OUT"
  "bgemm_tiles_gather|300|python3 benchmarks/bgemm_tiles.py --out $OUT --gather"
  "attention|360|python3 benchmarks/attention.py --out $OUT"
  "finetune_memory|540|python3 benchmarks/finetune_memory.py --out $OUT"
  "swiglu|120|python3 benchmarks/swiglu.py --out $OUT"
  "ledger_accuracy|240|python3 benchmarks/ledger_accuracy.py --out $OUT"
  "plan_fits|590|python3 benchmarks/plan_fits.py --out $OUT"
  "plan_fits_resume|590|python3 benchmarks/plan_fits.py --out $OUT --resume"
  "ledger_accuracy_blr|300|python3 benchmarks/ledger_accuracy.py --out $OUT --blr"
  "pick_cost|240|python3 benchmarks/pick_cost.py --out $OUT"
  "chain_tiles|300|python3 benchmarks/chain_tiles.py --out $OUT"
  "blr_counters|200|python3 benchmarks/blr_counters.py --out $OUT"
  "gpu_tests_blr|180|env MEMFIT_TEST_DEVICE=cuda python3 -m pytest -vv -rfE -n 9 -p no:cacheprovider --timeout 100 --tb=short tests/test_blr_kernels.py tests/test_tangents.py tests/test_blr_second_order.py"
  "gpu_tests_other|300|env MEMFIT_TEST_DEVICE=cuda python3 -m pytest -vv -rfE -n 12 -p no:cacheprovider --timeout 100 --tb=short tests/test_decode_kernels.py tests/test_decode_gemv.py tests/test_cache_attention.py tests/test_attention.py"
  "gpu_tests_blr_compile|120|env MEMFIT_TEST_DEVICE=cuda python3 -m pytest -vv -rfE -n 4 -p no:cacheprovider --timeout 90 --tb=short tests/test_blr_compile.py"
  "gpu_tests_swiglu|120|env MEMFIT_TEST_DEVICE=cuda python3 -m pytest -vv -rfE -n 4 -p no:cacheprovider --timeout 90 --tb=short tests/test_swiglu.py tests/test_checkpoint_offload.py"
  "gpu_tests_timing|120|env MEMFIT_TEST_DEVICE=cuda python3 -m pytest -vv -rfE -p no:cacheprovider --timeout 100 --tb=short tests/test_queued_timing.py"
  "gpu_tests_rest|500|env MEMFIT_TEST_DEVICE=cuda python3 -m pytest -vv -rfE -n 14 -p no:cacheprovider --timeout 200 --tb=short --junitxml $OUT/gpu_tests_rest.xml tests --ignore tests/test_blr_kernels.py --ignore tests/test_tangents.py --ignore tests/test_blr_second_order.py --ignore tests/test_decode_kernels.py --ignore tests/test_decode_gemv.py --ignore tests/test_cache_attention.py --ignore tests/test_attention.py --ignore tests/test_blr_compile.py --ignore tests/test_swiglu.py --ignore tests/test_checkpoint_offload.py --ignore tests/test_queued_timing.py --ignore tests/test_linear_ce.py"
  "compress_memory|560|python3 benchmarks/probes/compress_memory.py lowrank-aware blast lowrank"
  "compress_memory_blast300|570|python3 benchmarks/probes/compress_memory.py blast-300"
  "blast_step_time|240|python3 benchmarks/probes/blast_step_time.py"
  "monarch_refine_time|300|python3 benchmarks/probes/monarch_refine_time.py cuda"
  "prefill_chunks|150|python3 benchmarks/probes/prefill_chunks.py"
  "gpu_tests_linear_ce|540|env MEMFIT_TEST_DEVICE=cuda python3 -m pytest -vv -rfE -n 12 -p no:cacheprovider --timeout 300 --tb=short tests/test_linear_ce.py"
)
status=0
for run in "${RUNS[@]}"; do
  IFS='|' read -r name seconds command <<<"$run"
  if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
  echo "== $name (limit ${seconds}s)"
  timeout "$seconds" $command >"$OUT/$name.log" 2>&1
  code=$?
  tail -3 "$OUT/$name.log"
  [ $code -eq 0 ] || { echo "   $name exited $code"; status=1; }
done
exit $status
