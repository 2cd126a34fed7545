#!/usr/bin/env bash
# train.document_masking's kernels side by side on one GPU: causal (no mask), FlexAttention with the block mask and
# SDPA with the additive mask, in alternating rounds (off, flex, sdpa, off, flex, sdpa, ...) so that drift in
# clocks shows as spread within a kernel, not as a gap between kernels. One JSON per run in OUT_DIR.
# usage (repo root, a GPU):  bash packages/moe-train/bench/bench_document_masking.sh OUT_DIR [PRESET] [STEPS] [ROUNDS]
set -euo pipefail
out=${1:?usage: bench_document_masking.sh OUT_DIR [PRESET] [STEPS] [ROUNDS]}
preset=${2:-fine-grained-e8}
steps=${3:-6}
rounds=${4:-2}
mkdir -p "$out"
for round in $(seq "$rounds"); do
  for kernel in off flex sdpa; do
    if [ "$kernel" = off ]; then flags=(--train.document_masking=false)
    else flags=(--train.document_masking=true "--train.document_masking_kernel=$kernel"); fi
    python3 -m moe_train bench --preset "$preset" --steps "$steps" --warmup 3 "${flags[@]}" \
      --out "$out/bench_${preset}_docmask_${kernel}_${round}.json" | tail -n 1
  done
done
