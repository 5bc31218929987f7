#!/usr/bin/env bash
# GPU validation on a machine with a CUDA GPU and no network (the H200 of ../shared/gpu-environment.md):
# the plain test pass on real hardware, then compute-sanitizer memcheck on the kernel tests.
# Wheels in .whl/ (numpy 2.4.x for numba-cuda 0.30.4, gguf, ...) are installed ahead of the
# system packages. Logs go to $OUT (default ./gpu-logs).
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import numpy, numba, numba_cuda, torch, ml_dtypes; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'torch', torch.__version__, 'ml_dtypes', ml_dtypes.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
python3 -m pytest -q -rs -m "not sim and not model" tests/ 2>&1 | tee "$OUT/pytest-gpu.log" || rc=1
if [ "${MEMCHECK:-1}" = 1 ]; then
  compute-sanitizer --tool memcheck --report-api-errors no --print-limit 30 --error-exitcode 9 python3 -m pytest -q tests/test_gpu_norm.py \
    -k "${MEMCHECK_K:-not 64bit and not non_default_stream and not torch_compile and not hardware_conversions and not division}" \
    > "$OUT/memcheck.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log"
fi
exit $rc
