"""Deterministic, resumable sampling of fixed-length windows from a token stream.

The stream is cut into windows of seq_len + 1 tokens (inputs and shifted targets) starting every seq_len tokens:
window k is tokens[k*seq_len : (k+1)*seq_len + 1], its last token the next one's first, so every token but the
stream's first is a target once per epoch; the tokens after the last whole window are not drawn.
Epoch e visits the windows in a permutation seeded by (seed, e). The whole position is one
integer, `samples_seen` (global, over all data-parallel ranks), so resuming is exact.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_train.data.token_file import DataError, check_token_ids


class WindowSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, shuffle: bool = True,
                 vocab_size: int | None = None):
        """vocab_size: every window drawn is checked to hold only ids below it (None: not checked)."""
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_windows = (tokens.size - 1) // seq_len
        if self.num_windows < 1:
            where = f" ({tokens.filename})" if getattr(tokens, "filename", None) else ""
            count = f"{tokens.size} token{'' if tokens.size == 1 else 's'}"
            raise DataError(f"the train split{where} has {count}, fewer than one window of data.seq_len+1="
                            f"{seq_len + 1}; prepare more data or shorten data.seq_len")
        # The epoch's order, drawn at its first window: the one index that grows with the corpus (4 bytes a window;
        # 10^10 tokens of seq_len 128 are 312 MB).
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.uint32)
        self.samples_seen = 0

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of epoch `epoch`: `default_rng([seed, epoch]).permutation(num_windows)`, drawn as a
        shuffle of uint32 window numbers (the same draws, so the same order, in half the memory of int64)."""
        self._perm, self._perm_epoch = np.zeros(0, dtype=np.uint32), -1  # the last order freed before the next
        order = np.arange(self.num_windows, dtype=np.uint32 if self.num_windows <= 2**32 else np.int64)
        np.random.default_rng([self.seed, epoch]).shuffle(order)
        return order

    def _window(self, global_index: int) -> np.ndarray:
        epoch, i = divmod(global_index, self.num_windows)
        if self.shuffle and epoch != self._perm_epoch:
            self._perm, self._perm_epoch = self._epoch_order(epoch), epoch
        w = int(self._perm[i]) if self.shuffle else i
        start = w * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if self.vocab_size is not None:
            check_token_ids(window, self.vocab_size, self.tokens, start)
        return window

    def next_batch(self, batch_size: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch of world*batch_size windows; this rank's share: inputs, targets [B, S]."""
        base = self.samples_seen
        # With vocab_size, every rank checks the whole global batch, in one order: a bad window stops every rank
        # with the same error before the step's collectives. Checked by its own rank alone, it stopped that rank
        # while the others waited in a collective for it (on NCCL, until parallel.collective_timeout_s).
        checked = range(world) if self.vocab_size is not None else (rank,)
        rows = []
        for j in range(batch_size):
            for r in checked:
                window = self._window(base + j * world + r)
                if r == rank:
                    rows.append(window)
        self.samples_seen += batch_size * world
        arr = torch.from_numpy(np.stack(rows))
        return arr[:, :-1].contiguous(), arr[:, 1:].contiguous()

    def state_dict(self) -> dict:
        # num_windows: which data the position counts in (a resume on other data is warned about)
        return {"samples_seen": self.samples_seen, "seed": self.seed, "seq_len": self.seq_len,
                "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(f"sampler state has seq_len={state['seq_len']}, this run uses {self.seq_len}")
        self.samples_seen = int(state["samples_seen"])
        self.seed = int(state["seed"])
        self._perm_epoch = -1  # a permutation drawn before this load may be of another seed


def eval_windows(tokens: np.ndarray, seq_len: int, num_windows: int, max_batch_size: int,
                 vocab_size: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The eval set: min(num_windows, all) windows evenly spread over the split, as (inputs, targets)
    batches of at most max_batch_size windows (the last may be smaller). Average the batch losses
    weighted by batch size: then neither the set nor the mean depends on the micro-batch size or
    the parallel layout, only the float reduction order does. vocab_size: each window is checked to hold only
    ids below it (None: not checked)."""
    n = (tokens.size - 1) // seq_len
    want = max(0, min(n, num_windows))
    idx = np.linspace(0, n - 1, want).astype(np.int64) if want else np.zeros(0, dtype=np.int64)
    size = max(1, max_batch_size)
    out = []
    for b in range(0, want, size):
        rows = [np.asarray(tokens[i * seq_len : i * seq_len + seq_len + 1], dtype=np.int64) for i in idx[b : b + size]]
        if vocab_size is not None:
            for i, row in zip(idx[b : b + size], rows):
                check_token_ids(row, vocab_size, tokens, int(i) * seq_len)
        arr = torch.from_numpy(np.stack(rows))
        out.append((arr[:, :-1].contiguous(), arr[:, 1:].contiguous()))
    return out
