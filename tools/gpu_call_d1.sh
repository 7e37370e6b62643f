#!/usr/bin/env bash
# GPU call D1 (nvidia-h200-x2, ~9.5 min): stash a carried GGUF part under /root/parts (for the next warm
# call), causal-conv1d from its carried wheel, GPU tests of the newest code in the background while the
# warm-up variant compiles, then the 27B-shape pipeline (packed target): cuda-ipc (host RSS with the drafter
# now born on its GPU), anchor micro-batching, ring depth.
#   run(command="PART=.big/q1 bash tools/gpu_call_d1.sh", kind="nvidia-h200-x2",
#       carry=[".big/q1", ".build/cc", ".whl/<pyzmq>", ".whl/<flash_linear_attention>", ".whl/<fla_core>", ".whl/<setproctitle>", ".whl/<tomli_w>"], timeout_s=600)
set -u
BUDGET_S=${BUDGET_S:-575}
. tools/gpu_setup.sh
if [ -n "${PART:-}" ] && [ -d "$PART" ]; then mkdir -p /root/parts && cp "$PART"/* /root/parts/ && ls -la /root/parts; fi
if ls .build/cc/causal_conv1d-*.part* >/dev/null 2>&1; then
  mkdir -p /root/wheels && W=/root/wheels/$(basename $(ls .build/cc/*.part00) .part00)
  cat .build/cc/causal_conv1d-*.part* > "$W" && sha256sum "$W" && cat .build/cc/sha256.txt
fi
ls /root/wheels/causal_conv1d-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/wheels/causal_conv1d-*.whl
python3 -c "import causal_conv1d; print('causal_conv1d', causal_conv1d.__version__)" || echo "causal_conv1d missing"
nvidia-smi -L
(timeout -s INT ${TEST_S:-150} python3 -m pytest -q -m gpu -rA -p no:cacheprovider ${TESTS:-tests/test_drafter_model.py tests/test_ring_cuda.py} \
   > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $?" >> $OUT/gpu_tests.log) &
set -o pipefail
timeout -s INT $(( $(left) - 15 )) python3 -m dflash_ipc.cli bench pipeline --config ${CONFIG:-configs/h200-x2.toml} --steps ${STEPS:-8} \
  --variants ${VARIANTS:-warmup,cuda-ipc,anchors-8192,depth-8,depth-2} --out $OUT/variants.jsonl --json 2>$OUT/pipeline.err | tail -1 > $OUT/pipeline.json
wait
grep -E "passed|failed|PASSED|FAILED|rc " $OUT/gpu_tests.log | tail -20
grep -v "\] \[up\] step" $OUT/pipeline.err | tail -15
tail -c 2500 $OUT/pipeline.json
grep -h "GatedDeltaNet kernels\|forward packed\|forward padded" /tmp/dflash-bench-*/logs/target-*.log | cut -c1-300 | sort | uniq -c | head -4
tar czf $OUT/logs.tgz /tmp/dflash-bench-*/logs 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
