#!/usr/bin/env bash
# SmolLM2-135M on one H200: the target writes its own prompts (gen-data --prompts synth:N), answers them,
# answers the built-in questions too, then trains a drafter on the mix (data.weights) and evals it on the
# held-out synthesized and built-in prompts. Every stage is time-budgeted, prints progress and logs to $OUT
# (OUT/diversity.json: the synthesized set's diversity report).
#   run(command="bash tools/gpu_synth_smollm2.sh", kind="nvidia-h200", carry=[".whl"], timeout_s=600)
#   PHASE=data  ...: synthesis + answers only (the data lands in $W, kept on a warm machine);
#   PHASE=train ...: train on the data of an earlier PHASE=data call, then eval.
#   DRY_RUN=1 bash tools/gpu_synth_smollm2.sh   # the same chain on CPU at tiny sizes (configs/tiny-cpu.toml)
# Expects /root/models/smollm2 converted (tools/gpu_smollm2.sh does it) unless DRY_RUN.
# Knobs (env): PHASE (all|data|train), BUDGET_S, N_SYNTH, N_BUILTIN, SYNTH_BS, GEN_BS, GEN_MAX_NEW, HOLDOUT,
# DECODE (gen-data --decode: dynamic|static|compiled), SYNTH_S (seconds of sampling requests), SYNTH_GEN_S (seconds
# for synthesis + its answers), MULTI_TURN (0..1), MIX (weights "builtin,synth", e.g. "0.3,0.7"), TRAIN_S, STEP_S,
# MAX_STEPS, EPOCHS, BLOCK, UNTRAINED (a folder: export the untrained drafter there before training, inside the
# budget), EVAL (0: no eval after training, the suite does it), EVAL_N, EVAL_MAX_NEW, EVAL_RESERVE_S, EXTRA (more
# overrides), WORK, RUN (the run's name under WORK: run dir WORK/RUN, config WORK/RUN.toml; default "run", config
# train.toml), SETUP (0: tools/gpu_setup.sh already sourced by the caller).
set -u -o pipefail
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
stage() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$(mktemp -d /tmp/gpu-synth-out.XXXX)}
mkdir -p "$OUT"
# SETUP=0: the caller sourced tools/gpu_setup.sh already (its exports are inherited; a second one costs ~33 s)
if [ "${DRY_RUN:-0}" != 1 ] && [ "${SETUP:-1}" = 1 ]; then . tools/gpu_setup.sh; fi
python3 -c "import dflash_ipc.procs" 2>/dev/null || { echo "dflash_ipc.procs does not import: pip install -e . first"; exit 1; }
DF="python3 -m dflash_ipc.cli"
PHASE=${PHASE:-all}

if [ "${DRY_RUN:-0}" = 1 ]; then
  BUDGET_S=${BUDGET_S:-900}; W=${WORK:-$(mktemp -d /tmp/synth-dry.XXXX)}; BASE=configs/tiny-cpu.toml; DEV=cpu; MODEL=""
  N_SYNTH=${N_SYNTH:-16}; N_BUILTIN=${N_BUILTIN:-16}; SYNTH_BS=${SYNTH_BS:-8}; GEN_BS=${GEN_BS:-8}; GEN_MAX_NEW=${GEN_MAX_NEW:-8}
  HOLDOUT=${HOLDOUT:-0.25}; SYNTH_GEN_S=${SYNTH_GEN_S:-300}; TRAIN_S=${TRAIN_S:-8}; STEP_S=${STEP_S:-2}; EPOCHS=${EPOCHS:-4}
  EVAL_N=${EVAL_N:-2}; EVAL_MAX_NEW=${EVAL_MAX_NEW:-8}; EVAL_WORKERS=1
  # the random tiny target rarely ends a turn: keep its cut requests, short ones
  SYNTH_OV=("synth.max_prompt_tokens=8" "synth.drop_unfinished=false" "synth.min_chars=1")
  TOPO=('topology.targets=["cpu"]' 'topology.drafters=["cpu"]')
else
  BUDGET_S=${BUDGET_S:-570}; W=${WORK:-/root/work-synth}; BASE=${BASE:-configs/smollm2-1gpu-synth.toml}; DEV=cuda:0; MODEL=/root/models/smollm2
  # Batches: a 135M model's decode step is launch-bound (~45-58 ms at batch 512-768 on one H200, docs/EVAL.md), so
  # the batch sets the rate. Memory: SmolLM2's KV cache is 30 layers x 2 (K, V) x 3 kv heads x 64 x 2 bytes
  # = 23,040 B per token; 2048 rows x (<= 232 prompt + 320 new) tokens = 26 GB for the synthesized answers,
  # 2048 x (<= 512 + 320) = 39 GB for the longest built-in batch: both processes at once fit one H200 (141 GB).
  N_SYNTH=${N_SYNTH:-12000}; N_BUILTIN=${N_BUILTIN:-13504}; SYNTH_BS=${SYNTH_BS:-2048}; GEN_BS=${GEN_BS:-2048}; GEN_MAX_NEW=${GEN_MAX_NEW:-320}
  HOLDOUT=${HOLDOUT:-0.05}; SYNTH_GEN_S=${SYNTH_GEN_S:-300}; EPOCHS=${EPOCHS:-100}
  # STEP_S: seconds per step with target and drafter on one H200 (0.52 s steady on 2026-12-01, docs/EVAL.md); TRAIN_S:
  # seconds of steps (up's own start, ~90 s to the end of the first step, comes on top); a PHASE=train call has the
  # whole budget for training
  STEP_S=${STEP_S:-0.55}; if [ "$PHASE" = train ]; then TRAIN_S=${TRAIN_S:-420}; else TRAIN_S=${TRAIN_S:-180}; fi
  EVAL_N=${EVAL_N:-32}; EVAL_MAX_NEW=${EVAL_MAX_NEW:-128}; EVAL_WORKERS=${EVAL_WORKERS:-4}
  SYNTH_OV=()
  TOPO=('topology.targets=["cuda:0"]' 'topology.drafters=["cuda:0"]')
  [ -f "$MODEL/config.json" ] || { echo "$MODEL/config.json missing: convert SmolLM2 first (tools/gpu_smollm2.sh does)"; exit 1; }
fi
MIX=${MIX:-0.3,0.7}; BLOCK=${BLOCK:-8}
# SYNTH_S: seconds of sampling requests (synth.max_seconds: N_SYNTH is a ceiling, the budget decides how many).
# Answering, not sampling, bounds N_SYNTH: gen-data answered ~15 prompts/s per process at max-new 384 (docs/EVAL.md)
SYNTH_OV+=("synth.max_seconds=${SYNTH_S:-100}")
DECODE=${DECODE:-dynamic}
# MULTI_TURN: the share of answered synthesized requests that get a second user turn (and its answer)
[ "${MULTI_TURN:-0}" != 0 ] && SYNTH_OV+=("synth.multi_turn_fraction=$MULTI_TURN")
# the schedule fitted to TRAIN_S (training.max_seconds; the last checkpoint and the export come after it, so 30 s
# less); MAX_STEPS caps it (a comparison of schedules by step sets it)
MAX_SECONDS=${MAX_SECONDS:-$(python3 -c "print(max(1, int($TRAIN_S) - (30 if $TRAIN_S > 120 else 0)))")}
MAX_STEPS=${MAX_STEPS:-$(python3 -c "print(max(2, int(2 * $TRAIN_S / $STEP_S)))")}
MODEL_OV=(); [ -n "$MODEL" ] && MODEL_OV=("target.model_path=\"$MODEL\"")
mkdir -p "$W"
echo "out=$OUT work=$W base=$BASE phase=$PHASE budget=${BUDGET_S}s n_synth=$N_SYNTH n_builtin=$N_BUILTIN mix=$MIX max_seconds=$MAX_SECONDS max_steps=$MAX_STEPS"

if [ "$PHASE" != train ]; then
  python3 tools/derive_config.py "$BASE" "$W/gen.toml" "${MODEL_OV[@]}" "data.builtin_samples=$N_BUILTIN" "${TOPO[@]}" "${SYNTH_OV[@]}" \
    > "$OUT/derive.log" || exit 1
  # -- 1. both data sets at once on the one GPU (generation of a 135M model is latency-bound: two processes share it well)
  stage "gen-data: synth:$N_SYNTH (sampling batch $SYNTH_BS, ${SYNTH_S:-100} s) and $N_BUILTIN built-in questions (batch $GEN_BS, max-new $GEN_MAX_NEW, $DECODE decoding; $SYNTH_GEN_S s)"
  timeout -s INT "$SYNTH_GEN_S" $DF gen-data --config "$W/gen.toml" --prompts "synth:$N_SYNTH" --out "$W/synth.jsonl" --device $DEV \
    --holdout-fraction "$HOLDOUT" --batch-size "$SYNTH_BS" --max-new "$GEN_MAX_NEW" --decode "$DECODE" --json > "$OUT/gen_synth.log" 2>&1 &
  SYNTH_PID=$!
  timeout -s INT "$SYNTH_GEN_S" $DF gen-data --config "$W/gen.toml" --prompts builtin:stdlib-docs --out "$W/builtin.jsonl" --device $DEV \
    --holdout-fraction "$HOLDOUT" --batch-size "$GEN_BS" --max-new "$GEN_MAX_NEW" --decode "$DECODE" --json > "$OUT/gen_builtin.log" 2>&1 &
  BUILTIN_PID=$!
  # the synthesis answers with the sampling batch; progress of both, every 20 s
  while kill -0 $SYNTH_PID 2>/dev/null || kill -0 $BUILTIN_PID 2>/dev/null; do
    # a line every PROGRESS_S seconds, but no waiting on after both have ended
    for _ in $(seq "${PROGRESS_S:-20}"); do
      { kill -0 $SYNTH_PID 2>/dev/null || kill -0 $BUILTIN_PID 2>/dev/null; } || break
      sleep 1
    done
    echo "   [$(( $(date +%s) - T0 )) s] synth: $(grep -E '^(synth|gen-data):' "$OUT/gen_synth.log" | tail -n 1)"
    echo "   [$(( $(date +%s) - T0 )) s] builtin: $(grep '^gen-data:' "$OUT/gen_builtin.log" | tail -n 1)"
  done
  wait
  grep '^synth:' "$OUT/gen_synth.log" | tail -n 5
  cp "$W/synth.diversity.json" "$OUT/diversity.json" 2>/dev/null
  for s in synth builtin; do
    echo "gen-data $s: $(wc -l < "$W/$s.jsonl") train, $(wc -l < "$W/$s.holdout.jsonl") held-out records"
    [ -s "$W/$s.jsonl" ] && [ -s "$W/$s.holdout.jsonl" ] || { echo "gen-data $s produced no train or no held-out records"; exit 1; }
  done
  head -n 40 "$W/synth.prompts.jsonl" > "$OUT/synth_prompts_sample.jsonl"
  [ "$PHASE" = data ] && { stage "done (data; train with PHASE=train)"; exit 0; }
fi

# -- 2. train on the mix: built-in and synthesized answers by MIX's weights; held-out tau on the synthesized held-out prompts
IFS=, read -r W_BUILTIN W_SYNTH <<< "$MIX"
RUN=${RUN:-run}; RD=$W/$RUN; TOML=$W/$([ "$RUN" = run ] && echo train || echo "$RUN").toml
rm -rf "$RD"
python3 tools/derive_config.py "$BASE" "$TOML" "${MODEL_OV[@]}" "${TOPO[@]}" \
  "data.paths=[\"$W/builtin.jsonl\", \"$W/synth.jsonl\"]" "data.weights=[$W_BUILTIN, $W_SYNTH]" "data.num_epochs=$EPOCHS" \
  "data.holdout_paths=[\"$W/synth.holdout.jsonl\"]" "training.holdout_every=${HOLDOUT_EVERY:-50}" "training.holdout_batches=${HOLDOUT_BATCHES:-2}" \
  "training.holdout_max_new=$EVAL_MAX_NEW" "run.run_dir=\"$RD\"" "run.name=\"smollm2-synth\"" "training.max_steps=$MAX_STEPS" "training.max_seconds=$MAX_SECONDS" \
  "drafter.block_size=$BLOCK" ${EXTRA:-} >> "$OUT/derive.log" || exit 1
cp "$TOML" "$OUT/"
# the untrained floor for the suite, before training so it cannot push the call past its budget
if [ -n "${UNTRAINED:-}" ]; then
  stage "export-untrained -> $UNTRAINED"
  timeout 90 $DF export-untrained --config "$TOML" --out "$UNTRAINED" --device $DEV 2>&1 | tail -n 1
fi
# after training: SIGINT -> checkpoint + export (a few s), plan --json (bounded below), and the eval when EVAL=1
if [ "${EVAL:-1}" = 1 ]; then RESERVE=${EVAL_RESERVE_S:-90}; else RESERVE=${EVAL_RESERVE_S:-20}; fi
TRAIN_T=$(( $(left) - RESERVE ))
[ "$TRAIN_T" -ge 120 ] || { stage "only $TRAIN_T s left for training (up starts in ~90 s): not started"; exit 1; }
stage "train (block $BLOCK, max_seconds $MAX_SECONDS, max_steps $MAX_STEPS, ~${TRAIN_S}s; $TRAIN_T s)"
# worst case past BUDGET_S: a 30 s grace after SIGINT + plan's 30 s - RESERVE; give the call BUDGET_S + 45 s
timeout -s INT -k 30 $TRAIN_T $DF up --config "$TOML" > "$OUT/up.log" 2>&1
grep -E "^\[up\] (data|plan)" "$OUT/up.log" | head -n 3
grep -v "^\[up\] step" "$OUT/up.log" | tail -n 6
cp "$RD/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
# the mix realised per epoch (plan.json; the run's tokenized data is reused)
timeout 30 $DF plan --config "$TOML" --json > "$OUT/plan.json" 2> "$OUT/plan.log" && python3 - "$OUT/plan.json" <<'EOF'
import json, sys
p = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for s in p["mix"][0]["sources"]:
    print(f"mix epoch 0: {s['source']}: weight {s['weight']}, {s['records']} records ({s['records_pct']} %), {s['tokens']} tokens ({s['tokens_pct']} %), {s['passes']} passes")
EOF
[ -f "$RD/export/drafter/config.json" ] || { echo "no trained export"; exit 1; }

# -- 3. eval on both held-out sets at once (EVAL_N prompts each); EVAL=0: the suite does it (tools/gpu_eval_suite.sh)
L=$(left)
[ "${EVAL:-1}" = 1 ] || { stage "done (no eval: EVAL=0)"; exit 0; }
# `timeout 0` would mean no limit at all
[ "$L" -gt 35 ] || { stage "no time left for eval ($L s)"; exit 0; }
stage "eval (n $EVAL_N, max-new $EVAL_MAX_NEW; $L s left)"
for s in synth builtin; do
  timeout $(( L - 5 )) $DF eval --config "$TOML" --drafter "$RD/export/drafter" --prompts "$W/$s.holdout.jsonl" \
    --n "$EVAL_N" --max-new "$EVAL_MAX_NEW" --target-device $DEV --drafter-device $DEV --workers "$EVAL_WORKERS" --speed-prompts 1 \
    --json > "$OUT/eval_$s.json" 2> "$OUT/eval_$s.log" &
done
wait
stage "done"
for s in synth builtin; do
  python3 - "$OUT/eval_$s.json" "$s" <<'EOF'
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
    print(f"{sys.argv[2]} held-out: tau {r['tau']} lossless {str(r['lossless']).lower()} speedup {r.get('speedup')} prompts {r['prompts']}")
except (OSError, IndexError, ValueError, KeyError):
    print(f"{sys.argv[2]} held-out: no eval result (see eval_{sys.argv[2]}.log)")
EOF
done
