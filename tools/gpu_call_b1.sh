#!/usr/bin/env bash
# GPU call B1 (nvidia-h200-x2, ~9 min): causal-conv1d from its carried wheel (tools/build_causal_conv1d.sh
# made it on the GPU machine; .build/cc holds it in parts), every GPU test (SIGINT at the budget, so
# pytest still prints its summary), then the transport benchmark next to the raw peer copy, nccl
# included. Stashes a carried file part under /root (PART=.big/p1) for the next warm call.
#   run(command="PART=.big/p1 bash tools/gpu_call_b1.sh", kind="nvidia-h200-x2", carry=[".whl", ".big/p1"]  (add ".build/cc" when the tree has room: 64 MiB per call), timeout_s=600)
set -u
. tools/gpu_setup.sh
if [ -n "${PART:-}" ] && [ -d "$PART" ]; then mkdir -p /root/parts && cp "$PART"/* /root/parts/ && ls -la /root/parts; fi
if ls .build/cc/causal_conv1d-*.part* >/dev/null 2>&1; then
  mkdir -p /root/wheels && W=/root/wheels/$(basename $(ls .build/cc/*.part00) .part00)
  cat .build/cc/causal_conv1d-*.part* > "$W" && sha256sum "$W" && cat .build/cc/sha256.txt
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$W" && python3 -c "import causal_conv1d; print('causal_conv1d', causal_conv1d.__version__)"
fi
nvidia-smi -L
set -o pipefail
timeout -s INT -k 20 ${TESTS_S:-400} python3 -m pytest -q -m gpu -rA -s --durations=20 -p no:cacheprovider tests 2>&1 | tee $OUT/gpu_tests.log | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|FAULTS:|^E " | tail -60
echo "tests took $(( $(date +%s) - T0 )) s"
for a in "cuda-ipc --slot-mib 1024" "cuda-ipc --slot-mib 256" "nccl --slot-mib 1024" "nccl --slot-mib 256"; do
  L=$(left); [ "$L" -lt 25 ] && { echo "skipped [$a]: $L s left"; continue; }
  echo "== bench transport --backend $a" >> $OUT/transport.err
  timeout $(( L < 60 ? L : 60 )) python3 -m dflash_ipc.cli bench transport --backend $a --producers 1 --consumers 1 --slots 4 --seconds 2 --json 2>>$OUT/transport.err | tail -1 | tee -a $OUT/transport.jsonl
done
echo "total $(( $(date +%s) - T0 )) s"
