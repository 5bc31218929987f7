#!/usr/bin/env bash
# GPU validation on a machine with a CUDA GPU and no network (the H200 the device tool lends):
# the GPU test pass on real hardware, then compute-sanitizer memcheck on the kernel tests at
# small shapes. Wheels in .whl/ (numpy 2.4.x for numba-cuda 0.30.4, liger, gguf, ...) are
# installed ahead of the system packages. Logs go to $OUT (default ./gpu-logs).
#   TESTS="tests/test_norm_gpu.py ..."   restrict the GPU pass (default: every gpu-marked test)
#   MEMCHECK=0                           skip memcheck; MEMCHECK_FILES / MEMCHECK_K narrow it
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
python3 -m pytest -q -rs -m gpu ${TESTS:-tests/} 2>&1 | tee "$OUT/pytest-gpu.log" || rc=1
if [ "${MEMCHECK:-1}" = 1 ]; then
  compute-sanitizer --tool memcheck --report-api-errors no --print-limit 30 --error-exitcode 9 \
    python3 -m pytest -q -m gpu ${MEMCHECK_FILES:-tests/test_norm_gpu.py tests/test_reduce.py} \
    -k "${MEMCHECK_K:-not 64bit and not 2_31 and not non_default_stream and not torch_compile and not hardware_conversions and not second_device}" \
    > "$OUT/memcheck.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log"
fi
exit $rc
