#!/usr/bin/env bash
# Issue 9's GPU checks in one call of a lent device machine, from the repository root:
#     bash benchmarks/gpu_all.sh            # results under $OUT (default /tmp/gpu_out)
# Installs the wheels the device image lacks (.whl/: cryptography and its cffi / pycparser, which replica/ imports),
# then: the CUDA graph tests, decode steps and TTFT per mode for both models (gpu_decode.py), and greedy equality per
# mode (gpu_check.py). Each part has a time limit, so that a slow part leaves the others their time.
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-deps .whl/*.whl > "$OUT/pip.txt" 2>&1
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers as tf, triton as t; print(torch.__version__, tf.__version__, t.__version__)"
    nproc
} > "$OUT/machine.txt" 2>&1
part() {  # part NAME SECONDS COMMAND...: run with a limit, record its time and exit status
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s" | tee -a "$OUT/parts.txt"
}
part pytest_cuda_graphs 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py
part gpu_decode_smollm2 180 python3 benchmarks/gpu_decode.py --models smollm2-135m --modes compiled,graphs,eager \
    --profile
part gpu_decode_tiny 140 python3 benchmarks/gpu_decode.py --models tiny-llama-512x8 \
    --modes compiled,graphs,eager,eager-cudnn --profile
part gpu_check 140 env GPU_CHECK_ONLY=engine python3 benchmarks/gpu_check.py
tail -n 3 "$OUT"/*.txt
