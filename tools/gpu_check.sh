#!/usr/bin/env bash
# One device call: GPU tests, then the kernel, model and DDP benchmarks. Results land in $OUT.
# usage (on the GPU machine, repo root):  bash tools/gpu_check.sh COMMIT
set -u
commit=${1:-unknown}
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

stage() {  # stage NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s"; tail -n 4 "$out/$name.log"
}

stage gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
  packages/moe-kernels/tests/test_triton_gpu.py packages/moe-train/tests/test_model_gpu.py
stage kernel_bench 230 python3 packages/moe-kernels/bench/bench_moe_block.py --iters 6 --commit "$commit" \
  --out "$out/h200_moe_block.json"
stage train_bench 90 bash -c "python3 -m moe_train bench --preset tiny --steps 10 --warmup 3 --out $out/bench_tiny.json && \
  python3 -m moe_train bench --preset fine-grained-e8 --steps 5 --warmup 3 --out $out/bench_fg_e8.json"
stage ddp_bench 100 torchrun --nproc-per-node 1 packages/moe-parallel/bench/ddp_overhead.py --steps 8 --warmup 3 \
  --out "$out/ddp_overhead.json"
