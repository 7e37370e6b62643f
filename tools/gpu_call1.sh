#!/usr/bin/env bash
# GPU call 1 (nvidia-h200-x2, ~9.5 min): every GPU test, the transport benchmarks of issue 3, then
# `dflash-ipc bench gpu-ring --quick` (reference copies and two-process ring scenarios) if time is left.
#   run(command="bash tools/gpu_call1.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600)
# Each stage gets what is left of the call's budget; logs and JSON lines go to $OUT.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET_S:-575} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L; nvidia-smi topo -m | head -4
python3 -c "import torch, transformers, fla, zmq; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'zmq', zmq.__version__, 'gpus', torch.cuda.device_count())"
timeout ${TESTS_S:-300} python3 -m pytest -q -m gpu -rs --durations=15 tests 2>&1 | tee $OUT/gpu_tests.log | tail -25
echo "tests took $(( $(date +%s) - T0 )) s"
for a in "cuda-ipc --slot-mib 1024" "cuda-ipc --slot-mib 256" "host-pinned --slot-mib 256" "cuda-ipc --slot-mib 1024 --consumer-device same" "host-pinned --slot-mib 1024"; do
  L=$(left); [ "$L" -lt 30 ] && { echo "skipped [$a]: $L s left"; continue; }
  T1=$(date +%s)
  echo "== bench transport --backend $a" >> $OUT/transport.err
  timeout $L python3 -m dflash_ipc.cli bench transport --backend $a --producers 1 --consumers 1 --slots 4 --seconds 2 --json 2>>$OUT/transport.err | tail -1 | tee -a $OUT/transport.jsonl
  echo "transport [$a] took $(( $(date +%s) - T1 )) s"
done
L=$(left)
if [ "$L" -ge 120 ]; then
  T1=$(date +%s)
  timeout $L python3 -m dflash_ipc.cli bench gpu-ring --quick --out $OUT/gpu_ring.json 2>&1 | tail -30 | tee $OUT/gpu_ring.log
  echo "gpu-ring took $(( $(date +%s) - T1 )) s"
else
  echo "skipped [bench gpu-ring --quick]: $L s left"
fi
tar czf $OUT/logs.tgz /tmp/dflash-bench-*/logs /tmp/pytest-of-*/pytest-*/*/run*/logs 2>/dev/null
ls -la $OUT
