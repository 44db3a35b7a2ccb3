#!/usr/bin/env bash
# The checks that need a GPU machine (the `device` tool's runs; CI has no GPU): the CUDA tests, the CUDA rows of
# the benchmarks, and, since such a host's CPU has AVX-512 (and AMX on Xeons) where CI's may not, the CPU kernel
# tests on that ISA and, on an AMX host, the compute-bound linear table pinned to 2 cores.
#   bash benchmarks/run_device_checks.sh [OUT_DIR]
set -u
OUT=${1:-${OUT:-/tmp/device_out}}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi -L; lscpu | grep -E '^Model name|^CPU\(s\)'; grep -o 'amx_[a-z0-9]*\|avx512_vnni\|avx512_bf16\|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/machine.txt"
time python3 -c "import affineq.cpp as c, torch; print('cpp', c.is_available(), torch.ops.affineq_cpp.isa())" 2>&1 | tail -3
timeout 120 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_primitives.py tests/test_quantize.py \
  tests/test_tensor_affine.py 2>&1 | tail -15 | tee "$OUT/cuda_tests.txt"
timeout 150 python3 benchmarks/bench_cuda.py 2>&1 | tail -30 && cp benchmarks/results/bench_cuda.json "$OUT/" 2>/dev/null
KTESTS=${KTESTS:-tests/test_cpp_kernels.py tests/test_cpp_float_codes.py tests/test_compute_bound.py tests/test_static_output.py tests/test_kv_cache.py}
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 $KTESTS 2>&1 | tail -25 | tee "$OUT/cpu_isa_tests.txt"
if grep -q amx_tile /proc/cpuinfo && [ -z "${SKIP_AMX_BENCH:-}" ]; then
  timeout 240 taskset -c 0,1 python3 benchmarks/bench_linear.py --compute-bound --threads 2 --budget 0.25 \
    --out bench_linear_compute_bound_amx 2>&1 | tail -60 | tee "$OUT/amx_bench.txt"
  cp benchmarks/results/bench_linear_compute_bound_amx.json "$OUT/" 2>/dev/null
fi
true
