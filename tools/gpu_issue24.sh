#!/usr/bin/env bash
# Issue 24 on one H200 in warm calls (the machine keeps /root between them); the plan with each call's budget
# from the measured rates is in docs/EVAL.md (its last "GPU plan" section):
#   STEP=stash : stash the GGUF's first part (carried in .big/p1) under /root/parts for the data call, then (PROBE=1)
#                time gen-data's decoding on random SmolLM2-shaped weights: dynamic vs compiled cache at batch
#                512 and 2048 (tools/gen_decode_bench.py, $OUT/gen_decode.json) -> pick DECODE for the data call;
#                PROBE=drafter: the drafter step's speed options instead (tools/gpu_drafter_step.sh), for SPEED=auto
#                DATA=DIR (carried, e.g. .data/s6): unpack DIR/data.tgz* (a data call's $OUT) into the work folder, so
#                a later session trains recipes on the same data without a data call (then STEP=model, not data)
#   STEP=data  : join the GGUF (second part carried in .big/p2), convert it (DECODE=auto: the mode the stash call's
#                probe earns, tools/pick_decode.py), then synthesize + answer prompts and
#                answer the built-in questions (tools/gpu_synth_smollm2.sh PHASE=data); the data comes back as
#                $OUT/data.tgz (split in 15 MiB parts data.tgz.00, .01 when larger: a returned file's limit is 16 MiB)
#   STEP=model : the join + convert of STEP=data alone (after a stash with DATA=)
#   STEP=train : train on the mix (tools/gpu_synth_smollm2.sh PHASE=train EVAL=0), all inside BUDGET_S (give the call
#                BUDGET_S + 45 s); SPEED=auto: with the speed options the drafter probe earned
#                (tools/pick_drafter_speed.py); UNTRAINED=DIR exports the untrained floor first (else the eval call does);
#                KEEP=1 returns the exported drafter as $OUT/drafter.tgz.NN (15 MiB parts; STEP=stash DRAFTER=DIR
#                restores it in a later session, carried in a call of its own: ~37 MB)
#   STEP=eval  : the suite table (tools/gpu_eval_suite.sh): held-out synthesized, held-out built-in, HumanEval,
#                everyday; trained at T = 0 and T = 1, the untrained floor at T = 0 (exported first when missing;
#                FLOOR=0 skips it); RUN=NAME evaluates that run's drafter
# Knobs pass through to those scripts (BUDGET_S, N_SYNTH, N_BUILTIN, SYNTH_BS, DECODE, TRAIN_S, STEP_S, TEMPS, ...).
set -u
CALL_T0=$(date +%s)
W=${WORK:-/root/work-synth}
case "${STEP:?STEP=stash|data|train|eval}" in
  stash)
    mkdir -p /root/parts "$W"
    if [ -d .big/p1 ]; then cp .big/p1/smolpart.* /root/parts/ && ls -la /root/parts; fi
    if [ -n "${DATA:-}" ]; then
      cat "$DATA"/data.tgz* | tar xzf - -C "$W" || exit 1
      for s in builtin synth; do echo "restored $s: $(wc -l < "$W/$s.jsonl") train, $(wc -l < "$W/$s.holdout.jsonl") held-out records"; done
    fi
    # DRAFTER=DIR (carried alone: ~37 MB): a train call's KEEP=1 parts, i.e. W/RUN/export and its config
    if [ -n "${DRAFTER:-}" ]; then cat "$DRAFTER"/drafter.tgz* | tar xzf - -C "$W" && ls "$W"/*/export || exit 1; fi
    if [ "${PROBE:-1}" = drafter ]; then
      # the drafter step's speed options on this GPU (tools/gpu_drafter_step.sh); STEP=train SPEED=auto reads the pick
      mkdir -p "$W" && BUDGET_S=${PROBE_S:-140} bash tools/gpu_drafter_step.sh && cp "$OUT/drafter_step.json" "$W/drafter_step.json"
    elif [ "${PROBE:-1}" = 1 ]; then
      . tools/gpu_setup.sh
      timeout "${PROBE_S:-150}" python3 tools/gen_decode_bench.py --random-smollm2 --device cuda:0 --modes dynamic,compiled \
        --batch-sizes "${PROBE_BS:-512,2048}" --max-new "${PROBE_MAX_NEW:-64}" --batches 1 --out "$OUT/gen_decode.json" 2> "$OUT/gen_decode.log"
      echo "probe exit $?"; tail -n 5 "$OUT/gen_decode.log"; cp "$OUT/gen_decode.json" "$W/gen_decode.json" 2>/dev/null
    fi ;;
  data|model)
    mkdir -p /root/smollm2 /root/parts
    if [ ! -f /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
      cp .big/p2/smolpart.* /root/parts/ && cat /root/parts/smolpart.* > /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
    (cd /root/smollm2 && sha256sum -c "$OLDPWD/.big/p2/sha256.txt") || exit 1
    . tools/gpu_setup.sh
    if [ ! -f /root/models/smollm2/config.json ]; then
      python3 tools/convert_smollm2_gguf.py --gguf /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out /root/models/smollm2 2>&1 | tail -n 3
    fi
    [ "$STEP" = model ] && exit 0
    # BUDGET_S (the call's own limit, less ~10 s): generation gets what the join, convert and setup left, less the
    # archive's time, so the data always comes back inside the call (a call killed at its limit returns nothing)
    if [ -n "${BUDGET_S:-}" ]; then
      SYNTH_GEN_S=$(( BUDGET_S - ($(date +%s) - CALL_T0) - ${ARCHIVE_S:-25} )); export SYNTH_GEN_S
      echo "generation gets ${SYNTH_GEN_S} s of the ${BUDGET_S} s budget"
    fi
    if [ "${DECODE:-}" = auto ]; then  # the stash call's probe decides (tools/pick_decode.py; dynamic without one)
      DECODE=$(python3 tools/pick_decode.py "$W/gen_decode.json" --budget-s "${SYNTH_GEN_S:-280}" --batch-size "${GEN_BS:-2048}")
      export DECODE; cp "$W/gen_decode.json" "$OUT/" 2>/dev/null
    fi
    SETUP=0 PHASE=data bash tools/gpu_synth_smollm2.sh || exit 1
    # the data back to this session's checkout, for recipe runs of later sessions on the same records
    tar czf /root/data.tgz -C "$W" builtin.jsonl builtin.holdout.jsonl synth.jsonl synth.holdout.jsonl synth.diversity.json
    if [ "$(stat -c %s /root/data.tgz)" -le $((15 * 1024 * 1024)) ]; then cp /root/data.tgz "$OUT/data.tgz"
    else rm -f "$OUT/synth_prompts_sample.jsonl"; split -b 15M -d -a 2 /root/data.tgz "$OUT/data.tgz."; fi
    ls -la "$OUT"/data.tgz* ;;
  train)
    # the untrained floor is exported by the eval call (UNTRAINED=...: here instead, inside this budget)
    # SPEED=auto: the speed options the stash call's drafter-step probe earned (tools/pick_drafter_speed.py), if any
    BUDGET_S=${BUDGET_S:-550}; STARTED=$(date +%s)
    if [ "${SPEED:-}" = auto ]; then
      . tools/gpu_setup.sh && export SETUP=0
      PICK=$(python3 tools/pick_drafter_speed.py "$W/drafter_step.json"); echo "speed options: ${PICK:-none}"
      # the faster step holds more steps in TRAIN_S: max_steps (the cosine schedule's end) follows
      export EXTRA="${EXTRA:-} $PICK" STEP_S=$(python3 -c "print(round(${STEP_S:-0.55} / $(python3 tools/pick_drafter_speed.py --speedup "$W/drafter_step.json" 2>/dev/null), 4))")
      echo "step planned at $STEP_S s"
    fi
    # the setup above counts against the call's budget
    PHASE=train EVAL=0 UNTRAINED=${UNTRAINED:-} BUDGET_S=$(( BUDGET_S - ($(date +%s) - STARTED) )) bash tools/gpu_synth_smollm2.sh
    rc=$?
    if [ "${KEEP:-0}" = 1 ] && [ -d "$W/${RUN:-run}/export/drafter" ]; then
      # the drafter back to this session's checkout (a returned file is at most 16 MiB, at most 8 files): the
      # export and its config as 15 MiB parts, the small logs in one archive; STEP=stash DRAFTER=DIR restores it
      R=${RUN:-run}; C=$([ "$R" = run ] && echo train || echo "$R").toml
      tar czf /root/drafter-"$R".tgz -C "$W" "$R/export" "$C" && split -b 15M -d -a 2 /root/drafter-"$R".tgz "$OUT/drafter.tgz."
      cp -r "$W/$R/logs" "$OUT/proc_logs" 2>/dev/null  # the target's and drafter's own logs: where their start-up went
      (cd "$OUT" && tar czf logs.tgz --remove-files derive.log plan.json plan.log install.log proc_logs 2>/dev/null); ls -la "$OUT"
    fi
    exit $rc ;;
  eval)
    # FLOOR=0: the trained drafter alone (the untrained floor is 1.00 at every position in every table so far);
    # RUN=NAME: that training run's drafter; SETS=... (e.g. SETS=humaneval N_MAX=164 TEMPS=0) passes through
    RUN=${RUN:-run}; RD=$W/$RUN; TOML=$W/$([ "$RUN" = run ] && echo train || echo "$RUN").toml
    FLOOR_DRAFTER="untrained=$W/untrained"
    [ "${FLOOR:-1}" = 0 ] && FLOOR_DRAFTER=""
    if [ -n "$FLOOR_DRAFTER" ] && [ ! -f "$W/untrained/config.json" ]; then
      . tools/gpu_setup.sh && export SETUP=0
      timeout 90 python3 -m dflash_ipc.cli export-untrained --config "$TOML" --out "$W/untrained" --device cuda:0 2>&1 | tail -n 1
    fi
    CONFIG=$TOML DRAFTERS="trained=$RD/export/drafter $FLOOR_DRAFTER" TEMPS=${TEMPS:-"0 1"} \
      HOLDOUTS="synth=$W/synth.holdout.jsonl builtin=$W/builtin.holdout.jsonl" bash tools/gpu_eval_suite.sh ;;
esac
