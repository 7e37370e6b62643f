#!/usr/bin/env bash
# Build a causal-conv1d wheel on the GPU machine (no network there; the registry has no wheel for
# its torch): from the sdist and its build requirements carried in .build/ (causal_conv1d-*.tar.gz,
# ninja wheel), for TORCH_CUDA_ARCH_LIST only (the sdist's setup.py compiles for ten architectures
# regardless; a four-line patch, printed below, makes it honour the variable), no build isolation
# (it compiles against the installed torch), CAUSAL_CONV1D_FORCE_BUILD (never tries to download).
# The wheel lands in WHEEL_DIR (default /root/wheels); install it from there afterwards with
#   pip install --no-deps --no-index WHEEL_DIR/causal_conv1d-*.whl
#   fetch here:  pip download: see docs/BENCHMARKS.md ("causal-conv1d on the GPU")
set -eu -o pipefail
SRC=${SRC:-.build}
WHEEL_DIR=${WHEEL_DIR:-/root/wheels}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-8} CAUSAL_CONV1D_FORCE_BUILD=TRUE
T0=$(date +%s)
mkdir -p "$WHEEL_DIR" /tmp/ccbuild
python3 -m pip install -q --no-index --no-deps --target /tmp/ccbuild/tools "$SRC"/ninja-*.whl
export PATH=/tmp/ccbuild/tools/bin:$PATH PYTHONPATH=/tmp/ccbuild/tools:${PYTHONPATH:-}
ninja --version
tar xzf "$SRC"/causal_conv1d-*.tar.gz -C /tmp/ccbuild
cd /tmp/ccbuild/causal_conv1d-*
python3 - <<'PY'
import re
p = "setup.py"
s = open(p).read()
anchor = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI"
patch = (
    "    if os.getenv(\"TORCH_CUDA_ARCH_LIST\"):  # dflash-ipc build patch: only the listed architectures\n"
    "        _archs = os.environ[\"TORCH_CUDA_ARCH_LIST\"].replace(\";\", \" \").split()\n"
    "        cc_flag = [f for f in cc_flag if f != \"-gencode\" and not f.startswith(\"arch=compute_\")]\n"
    "        cc_flag += [x for a in _archs for x in (\"-gencode\", f\"arch=compute_{a.replace('.', '')},code=sm_{a.replace('.', '')}\")]\n"
)
assert anchor in s, "setup.py changed: patch anchor not found"
open(p, "w").write(s.replace(anchor, patch + anchor, 1))
print(patch)
PY
nvcc --version | tail -2
python3 -m pip wheel -v --no-deps --no-build-isolation -w "$WHEEL_DIR" . > /tmp/ccbuild/build.log 2>&1 || { tail -40 /tmp/ccbuild/build.log; exit 1; }
grep -c "nvcc" /tmp/ccbuild/build.log || true
ls -la "$WHEEL_DIR"
echo "causal-conv1d wheel built in $(( $(date +%s) - T0 )) s"
