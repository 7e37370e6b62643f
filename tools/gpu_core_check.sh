#!/usr/bin/env bash
# Issue 26 on one H200 (the role loops moved into the cores, heartbeats from a thread): the GPU
# suite (its two-GPU cases skip on one GPU), then the 27B-shape pipeline sharing the GPU
# (configs/h200-1gpu.toml: the forward-only ceiling, whose untimed first passes pay a cold machine's
# compiles, then the cuda-ipc pipeline). Two calls, one stage each, within the 600 s a command may run:
#   run(command="STAGE=tests bash tools/gpu_core_check.sh", kind="nvidia-h200", carry=[<the .whl/ wheels>], timeout_s=600)
#   run(command="STAGE=pipeline bash tools/gpu_core_check.sh", kind="nvidia-h200", carry=[<the .whl/ wheels>], timeout_s=600)
# The whole GPU suite needs ~460 s of pytest on one H200 (2026-12-02: 376 s for its first 37 tests, the three
# one-GPU pipeline cases ~100 s each): give it BUDGET_S=560 and timeout_s=590, or split it with TESTS (pytest's
# arguments, default "tests"), e.g. TESTS="tests/test_target_model.py tests/test_trainer.py tests/test_varlen.py".
# Writes $OUT/gpu_tests.log, or $OUT/pipeline.json + variants.jsonl + pipeline.err + pipeline_logs.tgz (the
# variants' process logs). The pipeline stage's budget (BUDGET_S) must leave ~20 s for that archive.
set -u
BUDGET_S=${BUDGET_S:-575}
. tools/gpu_setup.sh
nvidia-smi -L
case "${STAGE:-tests}" in
  tests)
    timeout -s INT $(( $(left) - 10 )) python3 -m pytest -q -m gpu -rA -p no:cacheprovider ${TESTS:-tests} > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc $?" >> "$OUT/gpu_tests.log"; tail -5 "$OUT/gpu_tests.log" ;;
  pipeline)
    set -o pipefail
    touch /tmp/pipeline-call-start  # the archive below takes this call's run dirs only, not an earlier warm call's
    timeout -s INT $(( $(left) - 15 )) python3 -m dflash_ipc.cli bench pipeline --config configs/h200-1gpu.toml --steps ${STEPS:-14} \
      --variants ${VARIANTS:-forward-only,cuda-ipc} --out "$OUT/variants.jsonl" --json 2>"$OUT/pipeline.err" | tail -1 > "$OUT/pipeline.json"
    echo "pipeline rc $?"; cat "$OUT/pipeline.json" | head -c 3000
    # each variant's process logs (the target's names its kernels and, with TORCH_LOGS=recompiles or
    # TRITON_PRINT_AUTOTUNING=1 set for the call, what it compiled or autotuned, batch by batch)
    find /tmp -maxdepth 1 -name 'dflash-bench-*' -newer /tmp/pipeline-call-start -printf '%f/logs\n' \
      | tar czf "$OUT/pipeline_logs.tgz" -C /tmp -T - 2>/dev/null; ls -la "$OUT/pipeline_logs.tgz" ;;
esac
