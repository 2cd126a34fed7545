#!/usr/bin/env bash
# model.sliding_window_pattern on one GPU: causal attention in every layer against windows in three of every four
# layers (OLMo 3's pattern) through FlexAttention and through SDPA with the additive mask, in alternating rounds
# (causal, flex, sdpa, causal, ...) so that drift in clocks shows as spread within a kernel, not as a gap between
# them. One JSON per run in OUT_DIR.
# usage (repo root, a GPU):  bash packages/moe-train/bench/bench_sliding_window.sh OUT_DIR [PRESET] [WINDOW] [STEPS] [ROUNDS]
set -euo pipefail
out=${1:?usage: bench_sliding_window.sh OUT_DIR [PRESET] [WINDOW] [STEPS] [ROUNDS]}
preset=${2:-fine-grained-e8}
window=${3:-1024}
steps=${4:-6}
rounds=${5:-2}
mkdir -p "$out"
for round in $(seq "$rounds"); do
  for kernel in causal flex sdpa; do
    if [ "$kernel" = causal ]; then flags=("--model.sliding_window_pattern=[]")
    else flags=("--model.sliding_window_pattern=[$window,$window,$window,0]" "--train.document_masking_kernel=$kernel"); fi
    python3 -m moe_train bench --preset "$preset" --steps "$steps" --warmup 3 "${flags[@]}" \
      --out "$out/bench_${preset}_window${window}_${kernel}_${round}.json" | tail -n 1
  done
done
