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
# name|seconds|command, most pending first (after the seventeenth session, 2026-12-01: see its closing note).
# The full fine-tuning table took 335 s at 869ff01 (over 320 s at 141a414, before the subset row stopped
# recompiling every step); the ledger's 24 accuracy jobs record their own times, 74 s together at 141a414
# (ledger_accuracy.json, the models' set-up not included).
# blr_e2e_memfit_attention took 330 s at most (the device call, with a layer subset before it, 397 s at 7bcc172).
# ledger_accuracy_blr: its 11 jobs took 228 s of their own at 074d5b1 (238 s device call; 8 jobs, 133 s, at d8e8e50).
# blr_layers_profile: its device call took 197 s at 36c466b, run alone (the file did not yet record its seconds; a
# first try after blr_e2e in one call ran past 165 s). blr_layers_profile.json now records them.
# The full layer table took one call at 89a2ab1 (558 s); where it runs past its limit, blr_layers_resume times the
# cases it lacks (a stopped run keeps every finished case; the resume says "nothing to resume" where it finished).
# blr_e2e --profile took 287 s at 1deb9e7; pick_cost's 42 first calls 107 s at 11b0a19; partial_ffn 115 s at 0a7cc7e.
RUNS=(
  "blr_e2e_memfit_attention|330|python3 benchmarks/blr_e2e.py --out $OUT --profile --no-eager --attention memfit"
  "ledger_accuracy_blr|300|python3 benchmarks/ledger_accuracy.py --out $OUT --blr"
  "blr_layers|590|python3 benchmarks/blr_layers.py --out $OUT"
  "blr_layers_resume|590|python3 benchmarks/blr_layers.py --out $OUT --resume"
  "blr_layers_profile|240|python3 benchmarks/blr_layers.py --out $OUT --profile-only"
  "pick_cost|200|python3 benchmarks/pick_cost.py --out $OUT"
  "decode_profile|240|python3 benchmarks/decode_profile.py --out $OUT"
  "partial_ffn|300|python3 benchmarks/partial_ffn.py --out $OUT --skip-accuracy"
  "blr_e2e|400|python3 benchmarks/blr_e2e.py --out $OUT --profile"
  "train_small_model|130|python3 benchmarks/train_small_model.py --out /tmp/small_llama --results $OUT --max-seconds 80"
  "partial_ffn_accuracy|150|python3 benchmarks/partial_ffn.py --out $OUT --skip-speed --small-model /tmp/small_llama"
  "linear_ce|330|python3 benchmarks/linear_ce.py --out $OUT"
  "blr_accuracy|300|python3 benchmarks/blr_accuracy.py --model /tmp/small_llama --out $OUT"
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
