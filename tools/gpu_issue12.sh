#!/usr/bin/env bash
# GPU call for the architecture issue (nvidia-h200 or -x2, ~9.5 min): every GPU test, then the
# transport benchmark next to the raw copy (TRANSPORTS: ';'-separated argument sets), then, with the
# time left, the drafter's weights digest at the 27B shapes (tools/digest_rss.py: host RSS of the
# streamed digest against the old whole-state copy). Optionally stashes a carried file part under
# /root (PART=.big/p1) for the next warm call.
#   run(command="bash tools/gpu_issue12.sh", kind="nvidia-h200-x2", carry=[".whl", ".build/cc", ".big/p1"], timeout_s=600)
set -u
. tools/gpu_setup.sh
if [ -n "${PART:-}" ] && [ -d "$PART" ]; then mkdir -p /root/parts && cp "$PART"/* /root/parts/ && ls -la /root/parts; fi
nvidia-smi -L; nvidia-smi topo -m | head -4
set -o pipefail
timeout ${TESTS_S:-330} python3 -m pytest -q -m gpu -rs --durations=12 -p no:cacheprovider tests 2>&1 | tee $OUT/gpu_tests.log | tail -30
echo "tests took $(( $(date +%s) - T0 )) s"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
SAME=""; [ "$NGPU" -lt 2 ] && SAME="--consumer-device same"  # one GPU: producer and consumer share it
IFS=';' read -ra RUNS <<< "${TRANSPORTS:-cuda-ipc --slot-mib 1024;cuda-ipc --slot-mib 256;host-pinned --slot-mib 256}"
for a in "${RUNS[@]}"; do
  a="$a $SAME"; L=$(left); [ "$L" -lt 40 ] && { echo "skipped [$a]: $L s left"; continue; }
  echo "== bench transport --backend $a" >> $OUT/transport.err
  timeout $L python3 -m dflash_ipc.cli bench transport --backend $a --producers 1 --consumers 1 --slots 4 --seconds 2 --json 2>>$OUT/transport.err | tail -1 | tee -a $OUT/transport.jsonl
done
L=$(left); if [ "$L" -gt 90 ]; then
  timeout $(( L - 10 )) python3 tools/digest_rss.py configs/h200-x2.toml cuda:0 2>&1 | tail -5 | tee $OUT/digest_rss.log
else echo "digest_rss skipped: $L s left"; fi
tar czf $OUT/logs.tgz /tmp/dflash-bench-*/logs /tmp/pytest-of-*/pytest-*/*/run*/logs 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
