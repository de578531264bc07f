#!/usr/bin/env bash
# The GPU checks, as one script for a machine with CUDA (run from the repo root):
#   bash benchmarks/gpu_check.sh [outdir]
# 1. the CUDA-marked tests (torch CUDA loops vs SparseAdam, DiskEmbedding on CUDA, the
#    article adapter with CUDA grads, NCCL sharding when >= 2 GPUs);
# 2. the JAX adapter tests on the default (GPU) backend;
# 3. the end-to-end torch benchmark with the table on the GPU, transfer cost per step.
# Uses the python on PATH (torch, jax, numba, pytest must be there). geoopt, when missing,
# comes from wheels in .whl/ if present.
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import geoopt" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/env.txt"
python3 -c "import torch, jax, numba, numpy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.version.cuda); print('jax', jax.__version__, jax.devices()); print('numba', numba.__version__, 'numpy', numpy.__version__)" | tee -a "$out/env.txt"
rc=0
python3 -m pytest -q -p no:cacheprovider -W default -m gpu -rs tests 2>&1 | tee "$out/tests_gpu.txt" || rc=1
python3 -m pytest -q -p no:cacheprovider -W default tests/adapters/jax/test_jax_adapter.py 2>&1 | tee "$out/tests_jax_gpu.txt" || rc=1
python3 -m benchmarks.torch_e2e --device cuda --rows 1000000 --steps 200 --dir /tmp 2>&1 | tee "$out/torch_e2e_cuda_1m.txt" || rc=1
cp benchmarks/results/torch_e2e_cuda.json "$out/torch_e2e_cuda_1m.json" 2>/dev/null
python3 -m benchmarks.torch_e2e --device cuda --rows 10000000 --steps 100 --dir /tmp 2>&1 | tee "$out/torch_e2e_cuda_10m.txt" || rc=1
cp benchmarks/results/torch_e2e_cuda.json "$out/torch_e2e_cuda_10m.json" 2>/dev/null
exit $rc
