#!/usr/bin/env bash
# The target at Qwen3.6-27B's shapes (and a 9B-class one) on one H200, random weights, no checkpoint needed:
#   1. the target's forward alone: padded vs packed, bf16 vs FP8, fused norms/SwiGLU (16 of the 64 layers);
#   2. the same at 9B-class shapes (all 32 layers);
#   3. the whole pipeline, target and drafter sharing the GPU (configs/h200-1gpu.toml): the forward-only
#      ceiling, then the cuda-ipc pipeline;
#   4. the same with the FP8 target.
#
#   pip install torch==2.13.0 && pip install -e ".[gpu]"     # the CUDA torch build, see README.md
#   bash examples/bench_27b_shapes.sh [OUT_DIR]              # ~25 minutes; STAGES=fwd27b,pipeline picks stages
#
# Expected on one H200 (docs/BENCHMARKS.md): 27B forward, packed FP8 fused ≈ 59 k tok/s = 2.2x padded bf16;
# 9B forward, packed FP8 fused ≈ 50 k tok/s = 1.8x padded bf16; pipeline forward-only ≈ 11.5 k tok/s, the
# pipeline ≈ 6.7-6.9 k target tok/s; FP8 forward-only ≈ 15.5 k tok/s, the pipeline ≈ 7.5 k.
# A variant of `bench pipeline` times every forward: forward-only goes first, its untimed first pass over each batch
# pays the compiles of a cold machine. Each stage writes JSON under OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-runs/bench-27b-shapes}; STAGES=${STAGES:-fwd27b,fwd9b,pipeline,pipeline-fp8}
mkdir -p "$OUT_DIR"
want() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() { echo "== [$SECONDS s] $*"; }
python -c "import torch, fla; assert torch.cuda.is_available(), 'no CUDA device'" \
  || { echo 'install first: pip install -e ".[gpu]" (and a CUDA build of torch)'; exit 1; }

if want fwd27b; then
  stage "27B-shape target forward, 16 of 64 layers, 8 batches: padded / packed, bf16 / FP8, fused"
  dflash-ipc bench target-forward --config configs/h200-1gpu.toml --layers 16 --batches 8 --profile --fuse \
    --out "$OUT_DIR/fwd27b.json"
fi
if want fwd9b; then
  stage "9B-class target forward, 32 layers, 8 batches"
  dflash-ipc bench target-forward --config configs/bench-9b-x2.toml --device cuda:0 --batches 8 --fuse \
    --out "$OUT_DIR/fwd9b.json"
fi
if want pipeline; then
  stage "pipeline, target and drafter on one H200 (bf16): forward-only ceiling, then cuda-ipc"
  dflash-ipc bench pipeline --config configs/h200-1gpu.toml --steps 10 --variants forward-only,cuda-ipc \
    --out "$OUT_DIR/pipeline.jsonl" --json | tail -n 1 > "$OUT_DIR/pipeline.json"
fi
if want pipeline-fp8; then
  stage "pipeline with the FP8 target (target.quantization = fp8)"
  dflash-ipc bench pipeline --config configs/h200-1gpu.toml --steps 10 --variants forward-only+fp8,cuda-ipc+fp8 \
    --out "$OUT_DIR/pipeline_fp8.jsonl" --json | tail -n 1 > "$OUT_DIR/pipeline_fp8.json"
fi
stage "done: $OUT_DIR"
