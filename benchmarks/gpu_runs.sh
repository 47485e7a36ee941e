#!/usr/bin/env bash
# Run memfit's GPU benchmarks in one go, most pending first, each under its own time limit,
# writing results and logs to OUT (default benchmarks/results). Usage on a CUDA machine:
#   OUT=/some/dir bash benchmarks/gpu_runs.sh [name ...]      # names: see RUNS below
# Competitor and bitsandbytes wheels, when needed, must already be importable (PYTHONPATH).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
# name|seconds|command, most pending first (after the fifteenth session, 2026-12-01: see its closing note).
# The full fine-tuning table took 335 s at 869ff01 (over 320 s at 141a414, before the subset row stopped
# recompiling every step); the ledger's 24 accuracy jobs record their own times, 74 s together at 141a414
# (ledger_accuracy.json, the models' set-up not included).
# The BLR runs tune every tile config from CUDA-graph replays since cba5eee: at 43f911d blr_layers took 467 s
# without --profile; at 18d9a39 its profile, run apart, 161 s, blr_e2e 288 s and blr_e2e_memfit_attention 148 s.
# Since the variant pick re-times its finalists and the table times by turns, blr_layers takes two calls: at
# 6a18df8 the first timed 28 of the 35 cases in 565 s, and blr_layers_resume the other 7 in about 150 s (a run stopped by
# its limit keeps every finished case; the resume says "nothing to resume" and exits 0 where the first finished).
# blr_e2e --profile took 287 s at 1deb9e7. Since 1deb9e7 every variant pick (the BLR layers, gemv, decode attention)
# times over rotating copies of its arguments: the full layer table, its profile, blr_e2e_memfit_attention,
# decode_profile and partial_ffn have not run with it (a Llama-1B subset of the table has).
RUNS=(
  "blr_layers|590|python3 benchmarks/blr_layers.py --out $OUT"
  "blr_layers_resume|590|python3 benchmarks/blr_layers.py --out $OUT --resume"
  "blr_layers_profile|240|python3 benchmarks/blr_layers.py --out $OUT --profile-only"
  "train_small_model|130|python3 benchmarks/train_small_model.py --out /tmp/small_llama --results $OUT --max-seconds 80"
  "partial_ffn_accuracy|150|python3 benchmarks/partial_ffn.py --out $OUT --skip-speed --small-model /tmp/small_llama"
  "decode_profile|240|python3 benchmarks/decode_profile.py --out $OUT"
  "linear_ce|330|python3 benchmarks/linear_ce.py --out $OUT"
  "blr_e2e|400|python3 benchmarks/blr_e2e.py --out $OUT --profile"
  "blr_e2e_memfit_attention|300|python3 benchmarks/blr_e2e.py --out $OUT --profile --no-eager --attention memfit"
  "blr_accuracy|300|python3 benchmarks/blr_accuracy.py --model /tmp/small_llama --out $OUT"
  "partial_ffn|300|python3 benchmarks/partial_ffn.py --out $OUT --skip-accuracy"
  "bgemm_tiles_gather|300|python3 benchmarks/bgemm_tiles.py --out $OUT --gather"
  "attention|360|python3 benchmarks/attention.py --out $OUT"
  "finetune_memory|450|python3 benchmarks/finetune_memory.py --out $OUT"
  "ledger_accuracy|240|python3 benchmarks/ledger_accuracy.py --out $OUT"
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
