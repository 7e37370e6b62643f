#!/usr/bin/env bash
# Issue 24 on one H200 in warm calls (the machine keeps /root between them):
#   STEP=data  : join the SmolLM2 GGUF (first part stashed under /root/parts by the call before, the second
#                carried in .big/p2), convert it, then synthesize + answer prompts and answer the built-in
#                questions (tools/gpu_synth_smollm2.sh PHASE=data)
#   STEP=train : train on the mix (tools/gpu_synth_smollm2.sh PHASE=train), export, export the untrained floor
#   STEP=eval  : the suite table (tools/gpu_eval_suite.sh): held-out synthesized, held-out built-in, HumanEval,
#                everyday; trained at T = 0 and T = 1, the untrained floor at T = 0
# Knobs pass through to those scripts (BUDGET_S, N_SYNTH, N_BUILTIN, SYNTH_BS, TRAIN_S, STEP_S, TEMPS, ...).
set -u
W=${WORK:-/root/work-synth}
case "${STEP:?STEP=data|train|eval}" in
  data)
    mkdir -p /root/smollm2 /root/parts
    if [ ! -f /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
      cp .big/p2/smolpart.* /root/parts/ && cat /root/parts/smolpart.* > /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
    (cd /root/smollm2 && sha256sum -c "$OLDPWD/.big/p2/sha256.txt") || exit 1
    . tools/gpu_setup.sh
    if [ ! -f /root/models/smollm2/config.json ]; then
      python3 tools/smollm2_to_hf.py --gguf /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out /root/models/smollm2 2>&1 | tail -n 3
    fi
    PHASE=data bash tools/gpu_synth_smollm2.sh ;;
  train)
    PHASE=train EVAL_RESERVE_S=${EVAL_RESERVE_S:-25} bash tools/gpu_synth_smollm2.sh
    python3 -m dflash_ipc.cli export-untrained --config "$W/train.toml" --out "$W/untrained" --device cuda:0 2>&1 | tail -n 1 ;;
  eval)
    CONFIG=$W/train.toml DRAFTERS="trained=$W/run/export/drafter untrained=$W/untrained" TEMPS=${TEMPS:-"0 1"} \
      HOLDOUTS="synth=$W/synth.holdout.jsonl builtin=$W/builtin.holdout.jsonl" bash tools/gpu_eval_suite.sh ;;
esac
