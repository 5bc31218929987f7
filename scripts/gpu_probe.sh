#!/usr/bin/env bash
# Exploratory GPU run (two GPUs): attention GPU tests on GPU 1; launch-config sweep and Nsight
# Compute sections on GPU 0. Needs only the numpy 2.4 wheel (.gpu-stage/np, carried).
# What it expects, none of it in this repository: the repository root as working directory on a
# two-GPU machine with torch (CUDA), numba-cuda 0.30.4 and ncu; a numpy 2.4.x cp312 manylinux
# wheel in .gpu-stage/np/, carried with the run (numba-cuda 0.30.4 fails on numpy 2.5; nothing
# else is staged, so gpu_stage.py is not needed), installed into /tmp/site; $OUT (default
# /tmp/out) for probe.tgz (/tmp/probe is scratch). PROVS (the --tune providers), CTX (the
# contexts) and NOTESTS=1 (skip the tests) change the run.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-stage/np/*.whl
export PYTHONPATH=/tmp/site:$PWD NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; R=/tmp/probe; mkdir -p $R $OUT
( [ -n "${NOTESTS:-}" ] || CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -q -x -m gpu tests/test_attention_gpu.py tests/test_attention_cases.py -p no:cacheprovider > $R/att_tests.log 2>&1; echo "rc=$?" >> $R/att_tests.log ) &
T=$!
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 benchmarks/bench_attention.py --tune --providers "${PROVS:-loomnb,loomnb_tt2,loomnb_tt8,loomnb_t256,loomnb_t64,loomnb_tt8_t64}" --batches 8,32 --context ${CTX:-32,1024,4096,16384} --order forward --no-exact --repeats 7 --out $R > $R/att_tune.log 2>&1
NCU="ncu --clock-control none --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py attention --num-seqs 32 --context 4096 > $R/ncu_att.txt 2>&1
timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py attention --num-seqs 32 --context 4096 --geometry 9/3/64 > $R/ncu_att_smol.txt 2>&1
timeout 60 $NCU -k regex:^kernel python3 benchmarks/probe_profile.py silu > $R/ncu_silu.txt 2>&1
wait $T
tar czf $OUT/probe.tgz -C $R .
tail -3 $R/att_tests.log; grep -E "FAILED|Error" $R/att_tests.log | head -5
grep -E "^\s*(paged|loomnb)|µs|us " $R/att_tune.log | tail -5
grep -hE "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Theoretical Occupancy|Block Limit Reg" $R/ncu_*.txt
