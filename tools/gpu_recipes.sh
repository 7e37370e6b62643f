#!/usr/bin/env bash
# Issue 24: training recipes side by side on one H200, all on the same kept records, compared at one step.
# Each recipe is one `up` (its own target and drafter, sharing the GPU with the others) of tools/gpu_issue24.sh's
# STEP=train with its own overrides; each is stopped (SIGINT: checkpoint + export) right after its held-out pass at
# STOP_AT, so every run is read at the same step by `tau_holdout` in its metrics.jsonl (eval's rule). Steps, not
# seconds, are compared: side by side each step takes longer, but a step learns the same (a fixed anchor budget,
# the same schedule: MAX_STEPS sets where the cosine is at each step).
#   RECIPES='run-sparse:drafter.num_anchors=96 data.token_budget=65536;run-kl:target.capture_last_hidden=true training.kl_weight=1.0'
#   STOP_AT=601 HOLDOUT_EVERY=300 MAX_STEPS=1673 BUDGET_S=530 bash tools/gpu_recipes.sh   (give the call BUDGET_S + 30)
# Needs the records and the model on the warm machine (gpu_issue24.sh STEP=stash DATA=..., then STEP=model).
# Returns $OUT/recipes.txt (held-out tau per pass, median step time) and $OUT/NAME.tgz per recipe (its logs, the
# processes' own logs, config and metrics.jsonl: at most 8 files come back from a call).
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-530}
W=${WORK:-/root/work-synth}
STOP_AT=${STOP_AT:-601}
OUT_ALL=${OUT:?OUT: where the logs go}
# DRY_RUN=1: the same on CPU at tiny sizes (WORK from `DRY_RUN=1 PHASE=data bash tools/gpu_synth_smollm2.sh`)
[ "${DRY_RUN:-0}" = 1 ] || . tools/gpu_setup.sh
export SETUP=0 STEP=train EVAL=0 MAX_STEPS=${MAX_STEPS:-1673} HOLDOUT_EVERY=${HOLDOUT_EVERY:-300} WORK=$W
IFS=';' read -ra SPECS <<< "${RECIPES:?RECIPES='NAME:overrides;NAME:overrides'}"
NAMES=()
for spec in "${SPECS[@]}"; do
  name=${spec%%:*}; extra=${spec#*:}
  mkdir -p "$OUT_ALL/$name"
  echo "recipe $name: $extra"
  # each run's budget: what the setup left, less the archive at the end
  OUT=$OUT_ALL/$name RUN=$name EXTRA="$extra" BUDGET_S=$(( BUDGET_S - ($(date +%s) - T0) - 15 )) \
    bash tools/gpu_issue24.sh > "$OUT_ALL/$name/call.log" 2>&1 &
  NAMES+=("$name")
done

# the step a run's last held-out pass ran at (0: none yet)
holdout_step() {
  python3 - "$1" <<'EOF'
import json, sys
last = 0
try:
    for line in open(sys.argv[1]):
        if '"tau_holdout"' in line:
            last = max(last, json.loads(line)["step"])
except (OSError, ValueError, KeyError):
    pass
print(last)
EOF
}

declare -A STOPPED
while [ -n "$(jobs -rp)" ]; do
  sleep 10
  for name in "${NAMES[@]}"; do
    [ -n "${STOPPED[$name]:-}" ] && continue
    step=$(holdout_step "$W/$name/metrics.jsonl")
    if [ "$step" -ge "$STOP_AT" ]; then
      # the up process itself (not the timeout wrapping it): one SIGINT, the run checkpoints, exports and ends
      pkill -INT -f "^python3 -m dflash_ipc.cli up --config $W/$name.toml" && STOPPED[$name]=1
      echo "[$(( $(date +%s) - T0 )) s] $name: held-out pass at step $step: stopped"
    fi
  done
  if [ $(( ($(date +%s) - T0) % 30 )) -lt 10 ]; then
    for name in "${NAMES[@]}"; do
      echo "[$(( $(date +%s) - T0 )) s] $name: $(grep '^\[up\] step' "$OUT_ALL/$name/up.log" 2>/dev/null | tail -n 1)"
    done
  fi
done
wait

for name in "${NAMES[@]}"; do
  python3 - "$W/$name/metrics.jsonl" "$name" <<'EOF'
import json, statistics, sys
rows = []
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except (OSError, ValueError):
    pass
passes = [(r["step"], r["tau_holdout"]) for r in rows if "tau_holdout" in r]
steps = [r["step_s"] for r in rows if r.get("step", 0) > 10 and "step_s" in r]
print(f"{sys.argv[2]}: {len(rows)} steps; held-out tau " + ", ".join(f"{t:.3f}@{s}" for s, t in passes)
      + (f"; median step {statistics.median(steps):.3f} s" if steps else ""))
EOF
done | tee "$OUT_ALL/recipes.txt"
for name in "${NAMES[@]}"; do
  cp "$W/$name.toml" "$OUT_ALL/$name/" 2>/dev/null
  cp -r "$W/$name/logs" "$OUT_ALL/$name/logs" 2>/dev/null  # each process's own log: where its start-up went
  tar czf "$OUT_ALL/$name.tgz" -C "$OUT_ALL" "$name" && rm -rf "${OUT_ALL:?}/$name"
done
ls -la "$OUT_ALL"
