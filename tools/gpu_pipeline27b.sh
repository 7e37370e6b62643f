#!/usr/bin/env bash
# The 64-layer Qwen3.6-27B-shape pipeline on nvidia-h200-x2 (~9 min): forward-only ceiling (its
# untimed first passes fill the compile caches), cuda-ipc pipeline. Optionally joins a file split over two warm calls
# (PART=.big/p2 carried now, the first part stashed in /root/parts by the previous call).
#   run(command="PART=.big/p2 bash tools/gpu_pipeline27b.sh", kind="nvidia-h200-x2", carry=[".whl", ".big/p2"], timeout_s=600)
set -u
. tools/gpu_setup.sh
if [ -n "${PART:-}" ] && [ -d "$PART" ]; then
  cp "$PART"/* /root/parts/ && mkdir -p /root/smollm2 && cat /root/parts/smolpart.* > /root/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  (cd /root/smollm2 && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf) ; cat /root/parts/sha256.txt
fi
set -o pipefail
timeout $(left) python3 -m dflash_ipc.cli bench pipeline --config ${CONFIG:-configs/h200-x2.toml} --steps ${STEPS:-8} \
  --variants ${VARIANTS:-forward-only,cuda-ipc} --out $OUT/variants.jsonl --json 2>$OUT/pipeline.err | tail -1 > $OUT/pipeline.json
grep -v "\] \[up\] step" $OUT/pipeline.err | tail -20
tail -c 3000 $OUT/pipeline.json
grep -h "GatedDeltaNet kernels\|off the critical path" /tmp/dflash-bench-*/logs/target-*.log | cut -c1-300 | head -4
tar czf $OUT/logs.tgz /tmp/dflash-bench-*/logs 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
