#!/usr/bin/env bash
# SmolLM2-135M end to end on two H200s in one device call (<= ~9.5 min): convert the GGUF, self-distil
# data with a held-out split, train with `dflash-ipc up` (~4 min), export the untrained drafter,
# eval both on the held-out prompts. Every stage is time-budgeted and logs to $OUT.
#   run(command="bash tools/gpu_smollm2.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600)
#   DRY_RUN=1 bash tools/gpu_smollm2.sh      # the same chain on CPU at tiny sizes (configs/tiny-cpu.toml)
# Expects /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf and the gguf package (or its wheel in .whl/).
# Two warm calls (10 minutes of training in two parts): PHASE=first (convert, gen-data, train every run of
# RUNS until the budget) then PHASE=second (`up --resume` each run, export-untrained, eval all); PHASE=all
# (default) does everything in one call. RUNS="b8:8 b16:16" trains a block-8 and a block-16 drafter at
# once (run i: target on GPU i%2, drafter on the other); "b8:8:dp2" trains one run with a drafter on each GPU.
# Knobs (env): PHASE, RUNS, BUDGET_S, N_PROMPTS, HOLDOUT, GEN_BS, GEN_MAX_NEW, TRAIN_S, STEP_S, MAX_STEPS, EPOCHS,
# EVAL_N, EVAL_MAX_NEW, EVAL_S_PER_PROMPT, EVAL_WORKERS (per GPU), SPEED_PROMPTS, HOLDOUT_EVERY, HOLDOUT_BATCHES,
# EVAL_RESERVE_S (seconds kept for export-untrained + eval, 120), EXTRA (more section.key=JSON overrides for the training config),
# ONE_GPU=1 (target and drafter both on cuda:0, for a one-GPU machine).
set -u -o pipefail
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
stage() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$(mktemp -d /tmp/gpu-smollm2-out.XXXX)}
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" != 1 ]; then . tools/gpu_setup.sh; fi  # wheels, the package importable, multicast off
python3 -c "import dflash_ipc.procs" 2>/dev/null || { echo "dflash_ipc.procs does not import: pip install -e . first"; exit 1; }
DF="python3 -m dflash_ipc.cli"

if [ "${DRY_RUN:-0}" = 1 ]; then
  BUDGET_S=${BUDGET_S:-1500}; W=${WORK:-$(mktemp -d /tmp/smollm2-dry.XXXX)}
  BASE=configs/tiny-cpu.toml; DEV0=cpu; DEV1=cpu; MODEL=""
  N_PROMPTS=${N_PROMPTS:-24}; HOLDOUT=${HOLDOUT:-0.25}; GEN_BS=${GEN_BS:-8}; GEN_MAX_NEW=${GEN_MAX_NEW:-16}
  TRAIN_S=${TRAIN_S:-8}; STEP_S=${STEP_S:-2}; EPOCHS=${EPOCHS:-4}
  EVAL_N=${EVAL_N:-2}; EVAL_MAX_NEW=${EVAL_MAX_NEW:-12}; FLOOR_N=2; FLOOR_MAX_NEW=12
  EVAL_WORKERS=${EVAL_WORKERS:-2}; SPEED_PROMPTS=${SPEED_PROMPTS:-1}; HOLDOUT_EVERY=${HOLDOUT_EVERY:-2}; HOLDOUT_BATCHES=${HOLDOUT_BATCHES:-1}
  TOPO=('topology.targets=["cpu"]' 'topology.drafters=["cpu"]')
else
  BUDGET_S=${BUDGET_S:-565}; W=${WORK:-/root/work-smollm2}
  BASE=configs/smollm2-x2.toml; DEV0=cuda:0; DEV1=cuda:1; MODEL=/root/models/smollm2
  N_PROMPTS=${N_PROMPTS:-2000}; HOLDOUT=${HOLDOUT:-0.05}; GEN_BS=${GEN_BS:-256}; GEN_MAX_NEW=${GEN_MAX_NEW:-384}
  # STEP_S: seconds per optimizer step of this config, measured in issue 13's run (616 steps in 125 s);
  # the train stage prints the rate it measured, feed it back here.
  TRAIN_S=${TRAIN_S:-200}; STEP_S=${STEP_S:-0.2}; EPOCHS=${EPOCHS:-100}
  EVAL_N=${EVAL_N:-64}; EVAL_MAX_NEW=${EVAL_MAX_NEW:-256}; FLOOR_N=16; FLOOR_MAX_NEW=128
  # 6 eval processes per GPU; speed is timed on SPEED_PROMPTS prompts decoded alone first.
  # Held-out tau in training: a pass of HOLDOUT_BATCHES batches of gen.holdout.jsonl every HOLDOUT_EVERY steps.
  EVAL_WORKERS=${EVAL_WORKERS:-6}; SPEED_PROMPTS=${SPEED_PROMPTS:-4}; HOLDOUT_EVERY=${HOLDOUT_EVERY:-50}; HOLDOUT_BATCHES=${HOLDOUT_BATCHES:-0}
  TOPO=()
  if [ "${ONE_GPU:-0}" = 1 ]; then  # one H200: target and drafter share cuda:0
    DEV1=cuda:0; TOPO=('topology.drafters=["cuda:0"]')
  fi
fi
PHASE=${PHASE:-all}; RUNS=${RUNS:-b8:8}
MAX_STEPS=${MAX_STEPS:-$(python3 -c "print(max(2, int($TRAIN_S / $STEP_S)))")}
# The last held-out pass lands a few steps before the end: a pass is queued behind the training batch
# that completes each HOLDOUT_EVERY steps, and a drafter that stops at exactly that step never scores it.
# With max_steps = k * HOLDOUT_EVERY + 5 the last tau_holdout measures step k * HOLDOUT_EVERY, five steps
# (at the cosine schedule's near-zero lr) before the export that eval decodes.
if [ "${HOLDOUT_EVERY:-0}" -gt 0 ] && [ "$MAX_STEPS" -gt "$HOLDOUT_EVERY" ]; then
  MAX_STEPS=$(( MAX_STEPS / HOLDOUT_EVERY * HOLDOUT_EVERY + 5 ))
fi
mkdir -p "$W"
echo "out=$OUT work=$W base=$BASE budget=${BUDGET_S}s max_steps=$MAX_STEPS"
[ "${DRY_RUN:-0}" = 1 ] || { nvidia-smi -L; python3 -c "import torch, transformers, gguf; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" || exit 1; }

# -- 1. GGUF -> Hugging Face folder (skipped when already there, and in a dry run: the tiny random target)
if [ -n "$MODEL" ] && [ ! -f "$MODEL/config.json" ]; then
  stage "convert"
  timeout $(( $(left) - 420 )) python3 tools/convert_smollm2_gguf.py --gguf /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out "$MODEL" 2>&1 \
    | tee "$OUT/convert.log" || { echo "convert failed"; exit 1; }
fi
MODEL_OV=(); [ -n "$MODEL" ] && MODEL_OV=("target.model_path=\"$MODEL\"")

if [ "$PHASE" != second ]; then
# -- 2. gen-data: the built-in questions, repeats dropped, in two shards, one per device, then joined (held-out split by prompt hash)
stage "gen-data ($N_PROMPTS prompts, batch $GEN_BS, max-new $GEN_MAX_NEW)"
python3 tools/derive_config.py "$BASE" "$W/gen.toml" "${MODEL_OV[@]}" "data.builtin_samples=$N_PROMPTS" "${TOPO[@]}" \
  | tee "$OUT/derive.log" || exit 1
python3 - "$W" "$N_PROMPTS" <<'EOF' || exit 1
import json, sys
from dflash_ipc.data.corpus import builtin_conversations
from dflash_ipc.data.gen import prompt_key
from dflash_ipc.data.readers import prompt_messages
w, n = sys.argv[1], int(sys.argv[2])
seen, recs = set(), []
for i, r in enumerate(builtin_conversations(n)):
    key = prompt_key(prompt_messages(r) or [])
    if key not in seen:  # the corpus repeats questions: one shard each, so no prompt is answered twice
        seen.add(key)
        recs.append((i, r))
print(f"prompts: {len(recs)} distinct of {n}")
for s in range(2):
    with open(f"{w}/prompts{s}.jsonl", "w") as f:
        for i, r in recs[s::2]:
            f.write(json.dumps({"id": f"builtin-{i}", "conversations": r["conversations"]}) + "\n")
EOF
GEN_T=$(( $(left) - 330 ))
for s in 0 1; do
  dev=$DEV0; [ $s = 1 ] && dev=$DEV1
  timeout -s INT $GEN_T $DF gen-data --config "$W/gen.toml" --prompts "$W/prompts$s.jsonl" --out "$W/gen$s.jsonl" --device $dev \
    --holdout-fraction $HOLDOUT --batch-size $GEN_BS --max-new $GEN_MAX_NEW --json > "$OUT/gen$s.log" 2>&1 &
done
wait
tail -n 2 "$OUT/gen0.log" "$OUT/gen1.log"
cat "$W/gen0.jsonl" "$W/gen1.jsonl" > "$W/gen.jsonl" 2>/dev/null
cat "$W/gen0.holdout.jsonl" "$W/gen1.holdout.jsonl" > "$W/gen.holdout.jsonl" 2>/dev/null
echo "gen-data: $(wc -l < "$W/gen.jsonl") train, $(wc -l < "$W/gen.holdout.jsonl") held-out records"
[ -s "$W/gen.jsonl" ] && [ -s "$W/gen.holdout.jsonl" ] || { echo "gen-data produced no train or no held-out records"; exit 1; }

fi

# -- 3. train: one `up` per run of RUNS ("name:block ...", run i: target on device i%2, drafter on the
# other), all at once; max_steps from the step rate; SIGINT at the time budget still checkpoints and
# exports. PHASE=first trains until the call's budget; PHASE=second resumes (`up --resume`, same
# max_steps: the cosine schedule ends where planned) and keeps EVAL_RESERVE_S for the evals.
DEVS=("$DEV0" "$DEV1")
read -r -a RUN_LIST <<< "$RUNS"
summary() {  # name
  local name=$1
  cp "$W/$name/metrics.jsonl" "$OUT/metrics-$name.jsonl" 2>/dev/null
python3 - "$W/$name" "$EPOCHS" <<'EOF'
import json, sys
from pathlib import Path
run, epochs = Path(sys.argv[1]), int(sys.argv[2])
m = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").exists() else {}
if len(m) < 2:
    sys.exit(f"train: only {len(m)} metrics lines")
# elapsed_s restarts with each `up` (a resumed run): time only the last process's records
restarts = [i for i in range(1, len(m)) if m[i]["elapsed_s"] < m[i - 1]["elapsed_s"]]
last = max([0] + restarts)
seg = m[last:] if len(m) - last >= 2 else m
k = min(len(seg) // 2, 10)  # skip the first steps (compile, warm-up) when timing
dt = seg[-1]["elapsed_s"] - seg[k]["elapsed_s"]
rate = (seg[-1]["step"] - seg[k]["step"]) / dt if dt > 0 else float("nan")
train_s = sum(m[i - 1]["elapsed_s"] for i in restarts) + m[-1]["elapsed_s"]
tail = m[-20:]
held = [(r["holdout_step"], r["tau_holdout"], r.get("tau_holdout_steps"), r.get("tau_holdout_uniform")) for r in m if "tau_holdout" in r]
print("tau_holdout (step, simulated-decode tau, its verify steps, uniform-anchor tau):", held)
per_epoch = plan.get("n_batches_total", 0) / epochs
batches = len(json.loads((run / "config.json").read_text())["config"]["topology"]["drafters"])  # per step: one per drafter rank
print(json.dumps({"train_steps": m[-1]["step"], "steps_per_s": round(rate, 2), "step_s": round(1 / rate, 4) if rate > 0 else None,
                  "train_elapsed_s": round(train_s, 1), "loss_last20": round(sum(r["loss"] for r in tail) / len(tail), 4),
                  "tau_train_last20": round(sum(r["tau"] or 0 for r in tail) / len(tail), 3),
                  "tau_marginal_last20": round(sum(r["tau_marginal"] for r in tail) / len(tail), 3),
                  "acc_last20": round(sum(r["acc"] or 0 for r in tail) / len(tail), 4),
                  "batches_per_epoch": round(per_epoch, 1), "epochs_seen": round(m[-1]["step"] * batches / per_epoch, 2) if per_epoch else None}))
EOF
}
if [ "$PHASE" = second ]; then RESERVE=${EVAL_RESERVE_S:-200}; elif [ "$PHASE" = first ]; then RESERVE=15; else RESERVE=${EVAL_RESERVE_S:-120}; fi
TRAIN_T=$(( $(left) - RESERVE ))
stage "train [$PHASE] (runs $RUNS; max_steps $MAX_STEPS, ~${TRAIN_S}s; $TRAIN_T s)"
i=0
for spec in "${RUN_LIST[@]}"; do
  IFS=: read -r name block dp <<< "$spec"
  td=${DEVS[$(( i % 2 ))]}; dd="\"${DEVS[$(( (i + 1) % 2 ))]}\""; i=$((i + 1))
  # "name:block:dp2": two data-parallel drafters, one on each device (the target shares the first):
  # the drafter is the bound of a 135M target, so a second drafter doubles the samples per second
  [ "${dp:-}" = dp2 ] && dd="\"$DEV0\", \"$DEV1\""
  RESUME=(--resume)
  if [ "$PHASE" != second ]; then
    RESUME=(); rm -rf "$W/$name"
    python3 tools/derive_config.py "$BASE" "$W/$name.toml" "${MODEL_OV[@]}" "data.paths=[\"$W/gen.jsonl\"]" "data.num_epochs=$EPOCHS" \
      "run.run_dir=\"$W/$name\"" "run.name=\"smollm2-$name\"" "training.max_steps=$MAX_STEPS" "drafter.block_size=$block" \
      "data.holdout_paths=[\"$W/gen.holdout.jsonl\"]" "training.holdout_every=$HOLDOUT_EVERY" "training.holdout_batches=$HOLDOUT_BATCHES" \
      "training.holdout_max_new=$EVAL_MAX_NEW" "topology.targets=[\"$td\"]" "topology.drafters=[$dd]" ${EXTRA:-} >> "$OUT/derive.log" || exit 1
    cp "$W/$name.toml" "$OUT/"
  fi
  timeout -s INT -k 60 $TRAIN_T $DF up --config "$W/$name.toml" "${RESUME[@]}" > "$OUT/up-$name-$PHASE.log" 2>&1 &
done
wait
for spec in "${RUN_LIST[@]}"; do
  name=${spec%%:*}
  echo "-- $name"; grep -v "^\[up\] step" "$OUT/up-$name-$PHASE.log" | tail -n 8
  summary "$name"
  [ -f "$W/$name/export/drafter/config.json" ] || { echo "$name: no trained export"; exit 1; }
done
[ "$PHASE" = first ] && { stage "done (first phase: resume with PHASE=second)"; exit 0; }

# -- 4. the untrained floor, in the first run's export layout
FIRST=${RUN_LIST[0]%%:*}
stage "export-untrained"
$DF export-untrained --config "$W/$FIRST.toml" --out "$W/untrained" 2>&1 | tail -n 3 | tee "$OUT/export_untrained.log"

# -- 5. eval on the held-out prompts, all at once: run i's trained export on device i%2 (EVAL_WORKERS processes),
# the floor on the second device. EVAL_S_PER_PROMPT: one prompt decoded both ways alone.
L=$(left)
SPP=${EVAL_S_PER_PROMPT:-15}
N=$(python3 -c "print(max(2, min($EVAL_N, int(($L - 60 - $SPEED_PROMPTS * $SPP) * $EVAL_WORKERS / $SPP))))")
stage "eval (trained: n $N max-new $EVAL_MAX_NEW; untrained: n $FLOOR_N max-new $FLOOR_MAX_NEW; $L s left)"
i=0
for spec in "${RUN_LIST[@]}"; do
  name=${spec%%:*}; dev=${DEVS[$(( i % 2 ))]}; i=$((i + 1))
  timeout $(( L - 10 )) $DF eval --config "$W/$name.toml" --drafter "$W/$name/export/drafter" --prompts "$W/gen.holdout.jsonl" \
    --n $N --max-new $EVAL_MAX_NEW --target-device $dev --drafter-device $dev --workers $EVAL_WORKERS --speed-prompts $SPEED_PROMPTS \
    --json > "$OUT/eval_$name.json" 2> "$OUT/eval_$name.log" &
done
timeout $(( L - 10 )) $DF eval --config "$W/$FIRST.toml" --drafter "$W/untrained" --prompts "$W/gen.holdout.jsonl" \
  --n $FLOOR_N --max-new $FLOOR_MAX_NEW --target-device $DEV1 --drafter-device $DEV1 --workers ${FLOOR_WORKERS:-4} --speed-prompts 1 --json > "$OUT/eval_untrained.json" 2> "$OUT/eval_untrained.log" &
wait
stage "done"
python3 - "$OUT" untrained "${RUN_LIST[@]%%:*}" <<'EOF'
import json, sys
from pathlib import Path
for name in sys.argv[2:]:
    p = Path(sys.argv[1]) / f"eval_{name}.json"
    lines = p.read_text().strip().splitlines() if p.exists() else []
    try:
        r = json.loads(lines[-1])
    except (IndexError, ValueError):
        print(f"{name}: no eval result (see eval_{name}.log)")
        continue
    print(f"{name}: tau {r['tau']} lossless {str(r['lossless']).lower()} speedup {r.get('speedup')} prompts {r['prompts']}"
          f" block {r.get('block_size')} workers {r.get('workers')} (speed: {r.get('speed_measured')})")
EOF
