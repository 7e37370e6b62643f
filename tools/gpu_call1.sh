#!/usr/bin/env bash
# GPU session, part 1 (nvidia-h200-x2): GPU tests, transport benchmarks, a short 27B-shape pipeline run.
# Run from the repo root on the lent machine with .whl carried; logs go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L
python3 -c "import torch, transformers, fla, zmq; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'zmq', zmq.__version__, 'gpus', torch.cuda.device_count())"
T0=$(date +%s)
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_pipeline.py tests/test_target_model.py 2>&1 | tee $OUT/gpu_tests.log | tail -15
echo "tests took $(( $(date +%s) - T0 )) s"
for a in "cuda-ipc --slot-mib 1024" "cuda-ipc --slot-mib 256" "cuda-ipc --slot-mib 1024 --consumer-device same" "host-pinned --slot-mib 256"; do
  T1=$(date +%s)
  timeout 90 python3 -m dflash_ipc.cli bench transport --backend $a --producers 1 --consumers 1 --slots 4 --seconds 3 --json 2>>$OUT/transport.err | tail -1 | tee -a $OUT/transport.jsonl
  echo "transport [$a] took $(( $(date +%s) - T1 )) s"
done
T2=$(date +%s)
timeout 200 python3 -m dflash_ipc.cli bench pipeline --config configs/bench-27b-8layer-x2.toml --steps 5 --variants cuda-ipc,forward-only --json 2>$OUT/pipeline8.err | tail -1 > $OUT/pipeline8.json
echo "pipeline8 took $(( $(date +%s) - T2 )) s"; tail -c 3000 $OUT/pipeline8.json; tail -20 $OUT/pipeline8.err
tar czf $OUT/logs.tgz /tmp/dflash-bench-*/logs /tmp/pytest-of-*/pytest-*/*/run/logs 2>/dev/null
ls -la $OUT
