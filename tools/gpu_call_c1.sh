#!/usr/bin/env bash
# GPU call C1 (nvidia-h200-x2, ~9.5 min): causal-conv1d from its carried wheel (gpu_setup.sh), GPU tests in the background (TESTS, default the varlen tests,
# GPU0 only unless TEST_DEVICES says otherwise) while the warm-up variant compiles, then the 27B-shape
# pipeline (VARIANTS: by default varlen vs padded forward-only, the cuda-ipc pipeline, anchor
# micro-batching and ring depth). Stashes a carried GGUF part under /root/parts for the next call.
#   run(command="PART=.big/q1 bash tools/gpu_call_c1.sh", kind="nvidia-h200-x2",
#       carry=[".big/q1", ".build/cc", ".whl/<pyzmq>", ".whl/<flash_linear_attention>", ".whl/<fla_core>", ".whl/<setproctitle>", ".whl/<tomli_w>"], timeout_s=600)
# The third session of 2026-11-30 ran it as (host RSS, anchors, depth; the drafter tests and ring tests):
#   PART=.big/q1 TEST_DEVICES=0,1 TEST_S=150 TESTS="tests/test_drafter_model.py tests/test_ring_cuda.py" \
#     VARIANTS=warmup,cuda-ipc,anchors-8192,depth-8,depth-2 BUDGET_S=575 bash tools/gpu_call_c1.sh
set -u
BUDGET_S=${BUDGET_S:-570}
. tools/gpu_setup.sh
if [ -n "${PART:-}" ] && [ -d "$PART" ]; then mkdir -p /root/parts && cp "$PART"/* /root/parts/ && ls -la /root/parts; fi
nvidia-smi -L
(CUDA_VISIBLE_DEVICES=${TEST_DEVICES:-0} timeout -s INT ${TEST_S:-240} python3 -m pytest -q -m gpu -rA -s -p no:cacheprovider ${TESTS:-tests/test_varlen.py} \
   > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $?" >> $OUT/gpu_tests.log) &
set -o pipefail
timeout -s INT $(( $(left) - 15 )) python3 -m dflash_ipc.cli bench pipeline --config ${CONFIG:-configs/h200-x2.toml} --steps ${STEPS:-8} \
  --variants ${VARIANTS:-warmup,varlen,padded,cuda-ipc,anchors-8192,depth-2,depth-8} --out $OUT/variants.jsonl --json 2>$OUT/pipeline.err | tail -1 > $OUT/pipeline.json
# A second invocation (VARIANTS2, STEPS2) after the first: e.g. the ring depths, which need only the
# host RSS, at fewer steps than the anchor variants; its Triton kernels are already in the disk cache.
if [ -n "${VARIANTS2:-}" ] && [ "$(left)" -gt 60 ]; then
  timeout -s INT $(( $(left) - 15 )) python3 -m dflash_ipc.cli bench pipeline --config ${CONFIG:-configs/h200-x2.toml} --steps ${STEPS2:-6} \
    --variants $VARIANTS2 --out $OUT/variants2.jsonl --json 2>$OUT/pipeline2.err | tail -1 > $OUT/pipeline2.json
  grep -v "\] \[up\] step" $OUT/pipeline2.err | tail -8
fi
wait
grep -E "passed|failed|PASSED|FAILED|max abs|rc " $OUT/gpu_tests.log | tail -20
grep -v "\] \[up\] step" $OUT/pipeline.err | tail -15
tail -c 2500 $OUT/pipeline.json
grep -h "GatedDeltaNet kernels\|forward packed\|forward padded" /tmp/dflash-bench-*/logs/target-*.log | cut -c1-400 | sort | uniq -c | head -6
tar czf $OUT/logs.tgz /tmp/dflash-bench-*/logs 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
