"""The attention masks of train.document_masking and model.sliding_window_pattern, in the two forms attention
takes them.

Document masking: a token attends to the earlier tokens of its own document; the data's eos_id ends each document
and belongs to the document it ends. A sliding window w: a token attends to itself and the w - 1 tokens before it
(Hugging Face's sliding_window). Both together: the keys both allow. Two kernels (train.document_masking_kernel,
which serves every masked layer, windowed ones included):
- "sdpa": scaled_dot_product_attention with one additive [B, 1, S, S] mask (attention_bias of attention_mask; [1,
  1, S, S] for a window alone). It runs everywhere, but the kernel that takes a mask computes every (query, key)
  pair and reads the mask: on a GPU, slower than the causal flash kernel (H100, fine-grained-e8, documents: 13%
  fewer tokens/s).
- "flex": FlexAttention (torch.compile'd) with a BlockMask built here from the document ids and the window
  (attention_block_mask): key blocks of other documents or past the window are skipped, blocks wholly allowed run
  without a mask, so shorter documents and windows cost less than the causal window. GPU only (torch has no
  FlexAttention backward on the CPU), for bf16 / fp16 / fp32 and head dims 16-128 that are powers of two
  (flex_document_attention_runs).
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
    return attention_mask(tokens, eos_id)


def attention_mask(tokens: torch.Tensor, eos_id: int | None, window: int = 0) -> torch.Tensor:
    """tokens [B, S] -> bool, True where query i (row) may attend key j (column): j <= i, both in the same document
    (eos_id; None = no document mask) and i - j < window (0 = no window). [B, 1, S, S]; [1, 1, S, S] without a
    document mask (it is the same for every row)."""
    s = tokens.shape[1]
    position = torch.arange(s, device=tokens.device)
    allowed = position.view(s, 1) >= position.view(1, s)
    if window:
        allowed = allowed & (position.view(s, 1) - position.view(1, s) < window)
    if eos_id is None:
        return allowed.view(1, 1, s, s)
    document = document_ids(tokens, eos_id)
    return ((document.unsqueeze(2) == document.unsqueeze(1)) & allowed).unsqueeze(1)


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive one scaled_dot_product_attention makes of it: 0 where True, -inf
    where False, in dtype (the query's)."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, float("-inf"))  # out of place: torch.func.vmap batches the mask alone


def document_block_mask(tokens: torch.Tensor, eos_id: int) -> BlockMask:
    """tokens [B, S] -> the BlockMask of document_attention_mask for flex_attention (attention_block_mask)."""
    return attention_block_mask(tokens, eos_id)


def attention_block_mask(tokens: torch.Tensor, eos_id: int | None, window: int = 0) -> BlockMask:
    """tokens [B, S] -> the BlockMask of attention_mask(tokens, eos_id, window) for flex_attention (every head
    alike; batch 1 without a document mask), built from the blocks' first and last document ids and positions,
    with no [B, S, S] tensor and no compile.

    Documents are numbered in order along a row, so for query block i and key block j (FLEX_BLOCK rows each):
    - (i, j) holds some allowed pair when j == i (the diagonal: a token attends to itself) or when j < i, key
      block j's last document is query block i's first and its last key is within the window of query block i's
      first query;
    - every pair of (i, j) is allowed (a "full" block, run without the mask) when j < i, key block j's first
      document is query block i's last and its first key is within the window of query block i's last query;
    - the others are skipped. The blocks that hold some allowed pair but not only those run with mask_mod."""
    s = tokens.shape[1]
    device = tokens.device
    document = (document_ids(tokens, eos_id) if eos_id is not None
                else torch.zeros(1, s, dtype=torch.int64, device=device))
    b = document.shape[0]
    n = -(-s // FLEX_BLOCK)
    starts = torch.arange(n, device=device) * FLEX_BLOCK
    first = document[:, starts]  # [B, n]
    last = document[:, (starts + FLEX_BLOCK - 1).clamp(max=s - 1)]
    q_block = torch.arange(n, device=device).view(n, 1)
    k_block = torch.arange(n, device=device).view(1, n)
    below = k_block < q_block  # [n (query), n (key)]
    some_near = full_near = below
    if window:
        # the nearest (query, key) pair of blocks j < i is (i * FLEX_BLOCK, j * FLEX_BLOCK + FLEX_BLOCK - 1), the
        # farthest (block i's last query, the sequence's last in the last block, j * FLEX_BLOCK)
        last_query = ((q_block + 1) * FLEX_BLOCK - 1).clamp(max=s - 1)
        some_near = below & ((q_block - k_block - 1) * FLEX_BLOCK + 1 < window)
        full_near = below & (last_query - k_block * FLEX_BLOCK < window)
    diagonal = torch.eye(n, dtype=torch.bool, device=device)
    some = diagonal | (some_near & (last.unsqueeze(1) == first.unsqueeze(2)))  # [B, query block, key block]
    full = full_near & (first.unsqueeze(1) == last.unsqueeze(2))
    partial = some & ~full
    # the kernels call mask_mod on the last block's padding too (positions S .. n * FLEX_BLOCK - 1): the ids are
    # padded so that those reads stay in bounds (a padded key is later than every real query, so causality drops it)
    padded = torch.full((b, n * FLEX_BLOCK), -1, dtype=torch.int32, device=device)
    padded[:, :s] = document

    # the window as a tensor the mask_mods read, not a Python int they close over: compiled flex_attention guards
    # on an int's value and compiles anew for each window size (3 sizes, train and eval, fp32 and bf16 reach
    # dynamo's recompile limit of 8, past which flex runs eagerly, holding every score); a tensor is an input
    window_size = torch.tensor(window, dtype=torch.int32, device=device)

    def causal(b_idx, h_idx, q_idx, kv_idx):  # without documents a batch of 1 serves every row: b_idx is not read
        return q_idx >= kv_idx

    def causal_in_window(b_idx, h_idx, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window_size)

    def same_document_causal(b_idx, h_idx, q_idx, kv_idx):
        return (padded[b_idx, q_idx] == padded[b_idx, kv_idx]) & (q_idx >= kv_idx)

    def same_document_in_window(b_idx, h_idx, q_idx, kv_idx):
        return same_document_causal(b_idx, h_idx, q_idx, kv_idx) & (q_idx - kv_idx < window_size)

    def block_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = blocks.sum(-1, dtype=torch.int32).unsqueeze(1)  # [B, 1 (every head), n]
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)  # listed blocks first
        return count, order.to(torch.int32).unsqueeze(1)

    kv_num_blocks, kv_indices = block_lists(partial)
    full_num_blocks, full_indices = block_lists(full)
    mask_mods = {(False, False): causal, (False, True): causal_in_window,  # (documents?, window?)
                 (True, False): same_document_causal, (True, True): same_document_in_window}
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_num_blocks, full_indices,
                                    BLOCK_SIZE=FLEX_BLOCK, seq_lengths=(s, s),
                                    mask_mod=mask_mods[eos_id is not None, bool(window)])


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
