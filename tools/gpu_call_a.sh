#!/usr/bin/env bash
# GPU call A (nvidia-h200-x2, ~9 min): causal-conv1d built from its sdist in the background
# (tools/build_causal_conv1d.sh), meanwhile every GPU test and the transport benchmark; then the
# varlen GPU test again with causal-conv1d installed (the seq_idx path), and the wheel copied to $OUT.
#   run(command="bash tools/gpu_call_a.sh", kind="nvidia-h200-x2", carry=[".whl", ".build"], timeout_s=600)
set -u
. tools/gpu_setup.sh
if [ -n "${PART:-}" ] && [ -d "$PART" ]; then mkdir -p /root/parts && cp "$PART"/* /root/parts/ && ls -la /root/parts; fi
nvidia-smi -L
(bash tools/build_causal_conv1d.sh > $OUT/ccbuild.log 2>&1; echo "build rc $?" >> $OUT/ccbuild.log) &
BUILD=$!
set -o pipefail
timeout ${TESTS_S:-330} python3 -m pytest -q -m gpu -rs -s --durations=15 -p no:cacheprovider tests 2>&1 | tee $OUT/gpu_tests.log | grep -v "^\[" | tail -45
echo "tests took $(( $(date +%s) - T0 )) s"
for a in "cuda-ipc --slot-mib 1024" "cuda-ipc --slot-mib 256" ${EXTRA_BACKENDS:-}; do
  L=$(left); [ "$L" -lt 150 ] && { echo "skipped [$a]: $L s left"; continue; }
  echo "== bench transport --backend $a" >> $OUT/transport.err
  timeout 60 python3 -m dflash_ipc.cli bench transport --backend $a --producers 1 --consumers 1 --slots 4 --seconds 2 --json 2>>$OUT/transport.err | tail -1 | tee -a $OUT/transport.jsonl
done
echo "waiting for the causal-conv1d build ($(left) s left)"
timeout $(( $(left) - 90 )) tail --pid=$BUILD -f /dev/null
tail -5 $OUT/ccbuild.log
W=$(ls /root/wheels/causal_conv1d-*.whl 2>/dev/null | head -1)
if [ -n "$W" ]; then
  ls -la "$W"; sha256sum "$W"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$W"
  python3 -c "import causal_conv1d, causal_conv1d_cuda; print('causal_conv1d', causal_conv1d.__version__, 'import ok')"
  timeout $(( $(left) - 15 )) python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_varlen.py 2>&1 | tail -5
  split -b 15000000 -d "$W" $OUT/$(basename "$W").part
fi
echo "total $(( $(date +%s) - T0 )) s"
