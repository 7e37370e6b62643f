#!/usr/bin/env bash
# The GPU tests on a fresh CUDA machine with torch, transformers and triton already installed (the project's GPU
# image): the wheels it lacks from .whl-peers/ (benchmarks/peers/README.md says which and how to download them)
# into $SITE, dflash-ipc importable with its process shells, then `pytest -m gpu`. Logs under $LOGS.
#   bash tools/gpu_tests.sh [PYTEST_ARGS...]        (default: -m gpu -n 4 tests)
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site} LOGS=${LOGS:-${OUT:-/tmp}/gpu-tests} WHL=${WHL:-.whl-peers}
mkdir -p "$LOGS" "$SITE"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
if ls "$WHL"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl || exit 1
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$LOGS/install.log" 2>&1; then
  echo "editable install failed ($LOGS/install.log): dflash_ipc.procs by a link"
  ln -sfn ../procs dflash_ipc/procs
  export PYTHONPATH=$PWD:$PYTHONPATH
fi
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))' \
  | tee "$LOGS/versions.txt"
[ $# -gt 0 ] || set -- -m gpu -n 4 tests
python3 -m pytest -q -p no:cacheprovider -rs --durations=15 "$@" 2>&1 | tee "$LOGS/pytest.log"
exit "${PIPESTATUS[0]}"
