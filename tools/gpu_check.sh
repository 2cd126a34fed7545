#!/usr/bin/env bash
# One device call (each part fits the 10-minute limit). Results land in $OUT.
# usage (on the GPU machine, repo root):  bash tools/gpu_check.sh COMMIT [kernels|tests1|tests2|others1|others2|model]
#   kernels (default): GPU tests (kernels + model), then the MoE block benchmark
#   tests1, tests2:    every test marked gpu in the workspace, in two calls (one no longer fits the 10-minute limit:
#                      at d04b402 on an H100, moe-kernels before test_triton_gpu.py took ~7 min, test_triton_gpu.py +
#                      moe-precision 220 s, moe-train + moe-ckpt 227 s). tests1: moe-kernels but test_triton_gpu.py;
#                      tests2: test_triton_gpu.py and the other packages
#   others1, others2:  the GPU tests outside the kernels and the dispatcher's (NCCL at world size 1, the seams), what
#                      a change that leaves the kernels alone needs, in two calls: one call ran 419-486 s on warm
#                      H100s and 558.6 s on a fresh one at 409be13 (the 570 s stage limit fired before it exited).
#                      others1: moe-train (~3/4 of the time); others2: moe-precision, moe-parallel, moe-ckpt and
#                      the dispatcher's
#   model:             training benches, fine-grained E=8/32/128, fp32 weights and bf16 resident
#                      weights (distributed optimizer at world size 1), one optimizer step per micro-batch
set -u
commit=${1:-unknown}
part=${2:-kernels}
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

case "$part" in
  kernels)
    stage gpu_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
      packages/moe-kernels/tests/test_triton_gpu.py packages/moe-train/tests/test_model_gpu.py
    stage kernel_bench 240 python3 packages/moe-kernels/bench/bench_moe_block.py --iters 6 --commit "$commit" \
      --out "$out/h200_moe_block.json"
    ;;
  tests1)
    stage gpu_tests_1 570 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 packages/moe-kernels/tests \
      --ignore packages/moe-kernels/tests/test_triton_gpu.py
    ;;
  tests2)
    stage gpu_tests_2 570 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
      packages/moe-kernels/tests/test_triton_gpu.py packages/moe-precision/tests packages/moe-parallel/tests \
      packages/moe-ckpt/tests packages/moe-train/tests
    ;;
  others1)
    stage gpu_tests_others1 570 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 packages/moe-train/tests
    ;;
  others2)
    stage gpu_tests_others2 570 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
      packages/moe-precision/tests packages/moe-parallel/tests packages/moe-ckpt/tests \
      packages/moe-kernels/tests/test_all_to_all_nccl_gpu.py packages/moe-kernels/tests/test_qa121_seams.py
    ;;
  model)
    for e in 8 32 128; do
      stage "train_bench_e$e" 100 python3 -m moe_train bench --preset "fine-grained-e$e" --steps 5 --warmup 3 \
        --out "$out/bench_fg_e$e.json"
      stage "train_bench_e${e}_bf16" 100 python3 -m moe_train bench --preset "fine-grained-e$e" --steps 5 --warmup 3 \
        --parallel.param_dtype=bf16 --out "$out/bench_fg_e${e}_bf16.json"
    done
    ;;
  *) echo "unknown part '$part': expected kernels, tests1, tests2, others1, others2 or model" >&2; exit 2 ;;
esac
