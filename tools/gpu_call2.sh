#!/usr/bin/env bash
# GPU session, part 2 (nvidia-h200-x2): transport at 1 GiB / 256 MiB, short 27B-shape pipeline.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
for a in "--slot-mib 1024" "--slot-mib 256"; do
  T1=$(date +%s)
  timeout 130 python3 -m dflash_ipc.cli bench transport --backend cuda-ipc $a --producers 1 --consumers 1 --slots 4 --seconds 2 --json 2>>$OUT/transport2.err | tail -1 | tee -a $OUT/transport2.jsonl
  echo "transport [$a] took $(( $(date +%s) - T1 )) s"
done
T2=$(date +%s)
timeout 230 python3 -m dflash_ipc.cli bench pipeline --config configs/bench-27b-8layer-x2.toml --steps 5 --variants cuda-ipc,forward-only --json 2>$OUT/pipeline8.err | tail -1 > $OUT/pipeline8.json
echo "pipeline8 took $(( $(date +%s) - T2 )) s"; tail -c 2500 $OUT/pipeline8.json; grep -v "^\[cuda-ipc\] \[up\] step\|^\[forward-only\] \[up\] step" $OUT/pipeline8.err | tail -12
tar czf $OUT/logs.tgz /tmp/dflash-bench-*/logs 2>/dev/null; ls -la $OUT
