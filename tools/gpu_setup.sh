# Sourced by the GPU call scripts: carried wheels into /tmp/site, causal-conv1d from its carried wheel
# parts (.build/cc; the joined wheel is kept under /root/wheels for later warm calls), the package
# importable from the work tree (editable install; if that is impossible there, dflash_ipc.procs
# mapped by a link), NVLink multicast off. Leaves T0 and left() for time-budgeted stages.
T0=$(date +%s)
left() { echo $(( ${BUDGET_S:-575} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
if ls .build/cc/causal_conv1d-*.part* >/dev/null 2>&1; then
  mkdir -p /root/wheels && W=/root/wheels/$(basename $(ls .build/cc/*.part00) .part00)
  cat .build/cc/causal_conv1d-*.part* > "$W" && sha256sum "$W" && cat .build/cc/sha256.txt
fi
ls /root/wheels/causal_conv1d-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/wheels/causal_conv1d-*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1; then
  echo "editable install failed (see install.log): mapping dflash_ipc.procs by a link"
  ln -sfn ../procs dflash_ipc/procs
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c "import setuptools, torch, transformers, zmq, dflash_ipc.procs.target as t; print('torch', torch.__version__, 'transformers', transformers.__version__, 'zmq', zmq.__version__, 'setuptools', setuptools.__version__, 'gpus', torch.cuda.device_count(), 'procs', t.__file__)" || exit 1
python3 -c "import fla; print('fla', fla.__version__)" || echo "fla missing"
python3 -c "import causal_conv1d; print('causal_conv1d', causal_conv1d.__version__)" || echo "causal_conv1d missing"
