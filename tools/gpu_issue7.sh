#!/usr/bin/env bash
# Issue 7 on nvidia-h200-x2 in one call (~8 min): the 64-layer Qwen3.6-27B-shape pipeline.
# A fresh machine has a cold Triton cache: 'warmup' (4 layers, same batches) fills it first. Carry .whl (pyzmq, flash-linear-attention, fla-core, setproctitle).
#   run(command="bash tools/gpu_issue7.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
STEPS=${STEPS:-10}
VARIANTS=${VARIANTS:-warmup,forward-only,cuda-ipc,host-pinned}
timeout ${LIMIT_S:-550} python3 -m dflash_ipc.cli bench pipeline --config ${CONFIG:-configs/h200-x2.toml} --steps $STEPS \
  --variants $VARIANTS --out $OUT/variants.jsonl --json 2>$OUT/pipeline.err | tail -1 > $OUT/pipeline.json
grep -v "\] \[up\] step" $OUT/pipeline.err | tail -25
tail -c 4000 $OUT/pipeline.json
grep -h "GatedDeltaNet kernels\|off the critical path" /tmp/dflash-bench-*/logs/target-*.log | cut -c1-400
tar czf $OUT/logs.tgz /tmp/dflash-bench-*/logs 2>/dev/null
