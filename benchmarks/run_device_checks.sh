#!/usr/bin/env bash
# The checks that need a GPU machine (the `device` tool's runs; CI has no GPU): the CUDA tests, the CUDA rows of
# the benchmarks, and, since such a host's CPU has AVX-512 (and AMX on Xeons) where CI's may not, CPU kernel
# tests on that ISA and, on an AMX host, the dequant_linear tuning table pinned to 2 cores. Every step's whole
# log goes to OUT_DIR; steps run in priority order, each under its own timeout.
#   bash benchmarks/run_device_checks.sh [OUT_DIR]
# Env: KTESTS (CPU tests to run one process, no xdist), SKIP_AMX_BENCH, TUNE_VARIANTS, TUNE_DTYPES.
set -u
OUT=${1:-${OUT:-/tmp/device_out}}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi -L; lscpu | grep -E '^Model name|^CPU\(s\)'; grep -o 'amx_[a-z0-9]*\|avx512_vnni\|avx512_bf16\|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } > "$OUT/machine.txt" 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"; }
step build 240 python3 -c "import affineq.cpp as c, torch; print('cpp', c.is_available(), torch.ops.affineq_cpp.isa())"
step cuda_tests 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=long -k cuda tests/test_primitives.py \
  tests/test_quantize.py tests/test_tensor_affine.py
step bench_cuda 120 python3 benchmarks/bench_cuda.py
cp benchmarks/results/bench_cuda.json "$OUT/" 2>/dev/null
KTESTS=${KTESTS:-tests/test_cpp_kernels.py}
[ -n "${SKIP_CPU_TESTS:-}" ] || step cpu_isa_tests 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -x $KTESTS
if grep -q amx_tile /proc/cpuinfo && [ -z "${SKIP_AMX_BENCH:-}" ]; then
  step tune_amx 200 taskset -c 0,1 python3 benchmarks/tune_dequant_linear.py --threads 2 --budget 0.15 \
    --variants "${TUNE_VARIANTS:-WT-1024,W-1024,WT-4096}" --dtypes "${TUNE_DTYPES:-bf16}" --out tune_dequant_linear_amx
  cp benchmarks/results/tune_dequant_linear_amx.json "$OUT/" 2>/dev/null
fi
true
