#!/usr/bin/env bash
# The drafter's training step alone on one H200 at configs/smollm2-1gpu-synth.toml's shapes (SmolLM2-135M
# shapes, random weights: no checkpoint needed), in variants of its speed options, with a per-op-class profile
# of each (issue 24, item 6). One call, all inside BUDGET_S:
#   run(command="bash tools/gpu_drafter_step.sh", kind="nvidia-h200", carry=[".whl"], timeout_s=150)
# Batches like the run's: ~51,800 target tokens of ~270-token documents, the config's anchors per document (96).
# Variants in order of importance (the JSON is rewritten after each, so a cut run keeps what it measured):
# eager (the baseline of every ratio), ce-chunk-8192, compile (drafter.compile), ce-compile, and all three.
# Out: $OUT/drafter_step.json (bench result: median phases, ratios, loss_step0 per variant, profiles),
# $OUT/drafter_step.log (progress and the profile tables).
# Knobs: BUDGET_S (140), VARIANTS, STEPS (8), BATCHES (2), TOKENS (51800), DOC_LEN (270), SUPERVISED (0.85).
set -u
BUDGET_S=${BUDGET_S:-140}
. tools/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
V=${VARIANTS:-eager,ce-chunk-8192,compile,ce-compile,compile+ce-compile+ce-chunk-8192}
timeout $(( $(left) - 5 )) python3 -m dflash_ipc.cli bench drafter-step --config configs/smollm2-1gpu-synth.toml \
  --random-target --device cuda:0 --variants "$V" --steps "${STEPS:-8}" --batches "${BATCHES:-2}" \
  --tokens "${TOKENS:-51800}" --doc-len "${DOC_LEN:-270}" --supervised "${SUPERVISED:-0.85}" --profile \
  --out "$OUT/drafter_step.json" > "$OUT/drafter_step.stdout" 2> "$OUT/drafter_step.log"
echo "bench exit $? after $(( $(date +%s) - T0 )) s"
grep -v "^\[drafter-step .*  step " "$OUT/drafter_step.log" | grep -v "^USDT" | tail -n 120
