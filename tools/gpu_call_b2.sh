#!/usr/bin/env bash
# GPU call B2 (nvidia-h200-x2, ~9.5 min): join the SmolLM2 GGUF (first part stashed under /root/parts by
# the previous warm call, the second carried now, sha256 checked), then the whole SmolLM2 chain
# (tools/gpu_smollm2.sh) with this session's recipe: every distinct built-in question, target on GPU0 and
# drafter on GPU1, held-out tau logged during training, eval with workers.
#   run(command="bash tools/gpu_call_b2.sh", kind="nvidia-h200-x2", carry=[".whl", ".big/p2"], timeout_s=600)
# P2: the carried folder of the second part (default .big/p2; .big/q2 for the 36 MB / 62 MB split).
set -u
P2=${P2:-.big/p2}
mkdir -p /root/smollm2
if [ ! -f /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  cp "$P2"/* /root/parts/ && cat /root/parts/smolpart.* > /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
(cd /root/smollm2 && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf); cat "$P2/sha256.txt"
export N_PROMPTS=${N_PROMPTS:-20000} GEN_BS=${GEN_BS:-768} GEN_MAX_NEW=${GEN_MAX_NEW:-384} TRAIN_S=${TRAIN_S:-220} STEP_S=${STEP_S:-0.2}
export HOLDOUT_EVERY=${HOLDOUT_EVERY:-100} HOLDOUT_BATCHES=${HOLDOUT_BATCHES:-0} EVAL_N=${EVAL_N:-64} EVAL_WORKERS=${EVAL_WORKERS:-8} SPEED_PROMPTS=${SPEED_PROMPTS:-2} EVAL_RESERVE_S=${EVAL_RESERVE_S:-160}
export EXTRA=${EXTRA:-"training.betas=[0.9,0.999] training.weight_decay=0.0 training.warmup_fraction=0.04 drafter.num_layers=5 training.loss_gamma=4.0"}
bash tools/gpu_smollm2.sh
