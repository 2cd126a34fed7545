"""The attention mask of train.document_masking, in the two forms attention takes it.

A token attends to the earlier tokens of its own document; the data's eos_id ends each document and belongs to the
document it ends. Two kernels (train.document_masking_kernel):
- "sdpa": scaled_dot_product_attention with one additive [B, 1, S, S] mask (attention_bias of
  document_attention_mask). It runs everywhere, but the kernel that takes a mask computes every (query, key) pair
  and reads the mask: on a GPU, slower than the causal flash kernel (H100, fine-grained-e8: 13% fewer tokens/s).
- "flex": FlexAttention (torch.compile'd) with a BlockMask built here from the document ids (document_block_mask):
  key blocks of other documents are skipped, blocks wholly inside one document run without a mask, so shorter
  documents cost less than the causal window. GPU only (torch has no FlexAttention backward on the CPU), for
  bf16 / fp16 / fp32 and head dims 16-128 that are powers of two (flex_document_attention_runs).
"auto" (the default) takes "flex" where it runs and "sdpa" elsewhere.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

FLEX_BLOCK = 128  # query and key rows per BlockMask block (FlexAttention's default)
FLEX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLEX_HEAD_DIMS = (16, 32, 64, 128)

_compiled_flex_attention = None  # torch.compile(flex_attention), made at the first flex call


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """tokens [B, S] -> [B, S] int64: the number of documents ended before each position (eos_id ends one and
    belongs to it). Non-decreasing along each row."""
    ends = tokens == eos_id
    return torch.cumsum(ends, dim=1) - ends.long()


def document_attention_mask(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """tokens [B, S] -> [B, 1, S, S] bool: query i may attend key j when j <= i and both are in the same document.
    A window's first tokens are the tail of a document begun before it, its last the head of one that goes on."""
    document = document_ids(tokens, eos_id)
    same = document.unsqueeze(2) == document.unsqueeze(1)
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril()
    return (same & causal).unsqueeze(1)


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive one scaled_dot_product_attention makes of it: 0 where True, -inf
    where False, in dtype (the query's)."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, float("-inf"))  # out of place: torch.func.vmap batches the mask alone


def document_block_mask(tokens: torch.Tensor, eos_id: int) -> BlockMask:
    """tokens [B, S] -> the BlockMask of document_attention_mask for flex_attention (every head alike), built from
    the blocks' first and last document ids, with no [B, S, S] tensor and no compile.

    Documents are numbered in order along a row, so for query block i and key block j (FLEX_BLOCK rows each):
    - (i, j) holds some allowed pair when j == i (the diagonal: a token attends to itself) or when j < i and key
      block j's last document is query block i's first;
    - every pair of (i, j) is allowed (a "full" block, run without the mask) when j < i and key block j's first
      document is query block i's last;
    - the others are skipped. The blocks that hold some allowed pair but not only those run with mask_mod."""
    b, s = tokens.shape
    document = document_ids(tokens, eos_id)
    n = -(-s // FLEX_BLOCK)
    starts = torch.arange(n, device=tokens.device) * FLEX_BLOCK
    first = document[:, starts]  # [B, n]
    last = document[:, (starts + FLEX_BLOCK - 1).clamp(max=s - 1)]
    q_block = torch.arange(n, device=tokens.device).view(n, 1)
    below = torch.arange(n, device=tokens.device).view(1, n) < q_block  # [n (query), n (key)]
    diagonal = torch.eye(n, dtype=torch.bool, device=tokens.device)
    some = diagonal | (below & (last.unsqueeze(1) == first.unsqueeze(2)))  # [B, query block, key block]
    full = below & (first.unsqueeze(1) == last.unsqueeze(2))
    partial = some & ~full
    # the kernels call mask_mod on the last block's padding too (positions S .. n * FLEX_BLOCK - 1): the ids are
    # padded so that those reads stay in bounds (a padded key is later than every real query, so causality drops it)
    padded = torch.full((b, n * FLEX_BLOCK), -1, dtype=torch.int32, device=tokens.device)
    padded[:, :s] = document

    def same_document_causal(b_idx, h_idx, q_idx, kv_idx):
        return (padded[b_idx, q_idx] == padded[b_idx, kv_idx]) & (q_idx >= kv_idx)

    def block_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = blocks.sum(-1, dtype=torch.int32).unsqueeze(1)  # [B, 1 (every head), n]
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)  # listed blocks first
        return count, order.to(torch.int32).unsqueeze(1)

    kv_num_blocks, kv_indices = block_lists(partial)
    full_num_blocks, full_indices = block_lists(full)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_num_blocks, full_indices,
                                    BLOCK_SIZE=FLEX_BLOCK, mask_mod=same_document_causal, seq_lengths=(s, s))


def flex_document_attention_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FlexAttention serves the document mask for attention in dtype on device with this head dim (see the
    module's docstring): what "auto" asks before taking it, and what "flex" requires."""
    return device.type == "cuda" and dtype in FLEX_DTYPES and head_dim in FLEX_HEAD_DIMS


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """q [B, H, S, D], k and v [B, KV, S, D] (KV divides H: grouped-query heads are shared, not copied) -> [B, H,
    S, D], attention restricted by block_mask, through torch.compile'd flex_attention (eager it would hold every
    score). Scaled by 1/sqrt(D), as scaled_dot_product_attention."""
    global _compiled_flex_attention
    if q.device.type == "cpu" or torch.compiler.is_compiling():
        run = flex_attention  # the CPU: forward-only checks; under train.compile the model's graph compiles it
    else:
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
        run = _compiled_flex_attention
    return run(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
