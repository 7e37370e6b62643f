#!/usr/bin/env bash
# GPU call C2 (nvidia-h200-x2, ~7 min): causal-conv1d from its carried wheel, this session's GPU tests
# (varlen kernel, streamed safetensors, GPU resume RNG) in the background on GPU0, then the 9B-shape
# pipeline: varlen vs padded forward-only (both warm), the cuda-ipc pipeline (ratio, host RSS with
# streamed checkpoints), ring depth 2 and 8.
#   run(command="bash tools/gpu_call_c2.sh", kind="nvidia-h200-x2",
#       carry=[".build/cc", ".whl/<pyzmq>", ".whl/<flash_linear_attention>", ".whl/<fla_core>", ".whl/<setproctitle>", ".whl/<tomli_w>"], timeout_s=...)
set -u
BUDGET_S=${BUDGET_S:-390}
. tools/gpu_setup.sh
mkdir -p /root/wheels && W=/root/wheels/causal_conv1d-1.7.0-cp312-cp312-linux_x86_64.whl
cat .build/cc/causal_conv1d-*.part* > "$W" && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$W"
python3 -c "import causal_conv1d; print('causal_conv1d', causal_conv1d.__version__)" || echo "causal_conv1d missing"
(CUDA_VISIBLE_DEVICES=0 timeout -s INT 200 python3 -m pytest -q -m gpu -rA -s -p no:cacheprovider tests/test_varlen.py tests/test_safetensors_stream.py tests/test_checkpoint.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc $?" >> $OUT/gpu_tests.log) &
timeout -s INT $(( $(left) - 12 )) python3 -m dflash_ipc.cli bench pipeline --config ${CONFIG:-configs/bench-9b-x2.toml} --steps ${STEPS:-16} \
  --variants ${VARIANTS:-warmup,varlen,padded,cuda-ipc,depth-2,depth-8} --out $OUT/variants.jsonl --json 2>$OUT/pipeline.err | tail -1 > $OUT/pipeline.json
wait
grep -E "passed|failed|PASSED|FAILED|max abs|rc " $OUT/gpu_tests.log | tail -14
grep -v "\] \[up\] step" $OUT/pipeline.err | grep -v "^INFO\|\[up\] data" | tail -12 | cut -c1-600
grep -h "GatedDeltaNet kernels\|forward packed\|forward padded" /tmp/dflash-bench-*/logs/target-*.log | cut -c1-300 | sort | uniq -c | head -4
echo "total $(( $(date +%s) - T0 )) s"
