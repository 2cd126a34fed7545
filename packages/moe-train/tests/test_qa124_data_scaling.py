"""QA 124: the data path as the corpus grows. What training holds in memory per window and per document, offsets
past 2^32 tokens, an eval share too small to count, and prepare-data's memory against the corpus's size (real CLI,
child processes). `tools/data_scaling.py` measures the same at 10-200 MB."""

import json
import tracemalloc

import numpy as np
import pytest

from moe_train.data import DataError, WindowSampler, eval_windows, open_data, prepare_data
from moe_train.data.prepare import eval_blocks
from moe_train.data.token_file import FORMAT, SplitWriter

from qa124_helpers import corpus_files, prepare_peak_rss


class Positions:
    """A token stream of `size` tokens whose token at position i is i: a window read shows where it was read."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __getitem__(self, s: slice) -> np.ndarray:
        return np.arange(s.start, min(s.stop, self.size), dtype=np.int64)


def traced_peak(fn) -> tuple[object, int]:
    """fn()'s result and the most bytes (numpy buffers included) it held at once."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def synthetic_folder(folder, train_tokens: int, docs: int = 1, marks: dict[int, int] | None = None):
    """A data folder as token_file.py defines it, of sparse files (no disk used): train_tokens zero tokens but
    `marks` ({position: id}), `docs` document ends in train.docs.u64, meta.json with max_token_id recorded."""
    folder.mkdir()
    with open(folder / "train.u32", "wb") as f:
        f.truncate(4 * train_tokens)
        for pos, token in (marks or {}).items():
            f.seek(4 * pos)
            f.write(np.array([token], dtype="<u4").tobytes())
    with open(folder / "train.docs.u64", "wb") as f:
        f.truncate(8 * docs)
    np.zeros(4096, dtype="<u4").tofile(folder / "eval.u32")
    np.array([4096], dtype="<u8").tofile(folder / "eval.docs.u64")
    top = max((marks or {0: 0}).values())
    splits = {"train": {"num_tokens": train_tokens, "num_docs": docs, "max_token_id": top},
              "eval": {"num_tokens": 4096, "num_docs": 1, "max_token_id": 0}}
    (folder / "meta.json").write_text(json.dumps({"format": FORMAT, "vocab_size": 512, "eos_id": 0, "splits": splits}))
    return folder


def test_sampler_holds_no_per_window_index_before_its_first_draw():
    """Building the sampler allocated an arange of every window (8 bytes each) that nothing read: 80 MB here,
    625 MB at 10^10 tokens of seq_len 128."""
    sampler, peak = traced_peak(lambda: WindowSampler(Positions(10**7 * 128 + 1), 128, seed=0))
    assert sampler.num_windows == 10**7
    assert peak < 1 << 20, f"{peak / 1e6:.1f} MB held by WindowSampler.__init__"


def test_sampler_epoch_order_costs_four_bytes_a_window_at_its_peak():
    """The one index that grows with the corpus: the epoch's order, 4 bytes a window while drawn and after (it was
    8 bytes, and the old order or the unused arange was still held while the next was drawn: 16)."""
    windows = 2_000_000
    sampler = WindowSampler(Positions(windows * 16 + 1), 16, seed=3)
    _, first = traced_peak(lambda: sampler.next_batch(4))
    sampler.samples_seen = windows  # the next draw starts epoch 1
    _, next_epoch = traced_peak(lambda: sampler.next_batch(4))
    assert first < 4.5 * windows and next_epoch < 4.5 * windows, (first / windows, next_epoch / windows)


@pytest.mark.parametrize("seed", [0, 1234])
def test_sampler_order_is_still_the_int64_permutation_of_seed_and_epoch(seed):
    """The uint32 order must be the one checkpoints were trained in: default_rng([seed, epoch]).permutation(n)."""
    n = 1000
    sampler = WindowSampler(Positions(n * 4 + 1), 4, seed=seed)
    for epoch in range(3):
        drawn = [int(x[0, 0]) // 4 for x, _ in (sampler.next_batch(1) for _ in range(n))]
        assert drawn == np.random.default_rng([seed, epoch]).permutation(n).tolist()


def test_open_data_maps_document_ends_instead_of_reading_them(tmp_path):
    """train.docs.u64 (8 bytes a document, never read by training) was read whole into memory at start-up."""
    docs = 10**7
    folder = synthetic_folder(tmp_path / "d", train_tokens=docs * 4, docs=docs)
    (_, splits), peak = traced_peak(lambda: open_data(folder, 512))
    assert splits["train"].doc_ends.shape == (docs,) and splits["train"].doc_ends.dtype == np.dtype("<u8")
    assert peak < 4 << 20, f"{peak / 1e6:.1f} MB held by open_data for {docs:,} document ends (80 MB of file)"


def test_a_train_split_past_2_to_the_32_tokens_opens_without_a_read_and_draws_the_right_offsets(tmp_path):
    """uint32 tokens, uint64 offsets: a window starting past token 2^32 reads the tokens that are there."""
    seq_len, n = 1 << 16, (1 << 32) + (1 << 20)
    window = (1 << 32) // seq_len + 3  # starts past 2^32
    marks = {window * seq_len: 7, window * seq_len + seq_len: 9}  # its first token, and its last (the next's first)
    folder = synthetic_folder(tmp_path / "d", train_tokens=n, marks=marks)
    (meta, splits), peak = traced_peak(lambda: open_data(folder, 512))
    assert splits["train"].tokens.size == n and peak < 1 << 20
    sampler = WindowSampler(splits["train"].tokens, seq_len, seed=0, shuffle=False, vocab_size=512)
    assert sampler.num_windows == (n - 1) // seq_len
    sampler.samples_seen = window
    x, y = sampler.next_batch(1)
    assert x[0, 0] == 7 and y[0, -1] == 9 and int(x.sum()) == 7


def test_eval_windows_and_shuffled_draws_read_exact_offsets_at_1e10_tokens():
    """Window starts are int64 (linspace in float64 is exact far past 10^10): every eval window starts on a
    window boundary, the first at 0 and the last at the split's last whole window; draws likewise."""
    n, seq_len = 10**10 + 5, 8192
    windows = (n - 1) // seq_len
    batches = eval_windows(Positions(n), seq_len, 64, 16)
    starts = [int(s) for x, _ in batches for s in x[:, 0]]
    assert len(starts) == 64 and starts[0] == 0 and starts[-1] == (windows - 1) * seq_len
    assert all(s % seq_len == 0 for s in starts) and starts == sorted(set(starts))
    assert all(np.array_equal(x[:, 1:], y[:, :-1]) and int(y[:, -1].max()) < n for x, y in batches)
    x, y = WindowSampler(Positions(n), seq_len, seed=5).next_batch(8)
    assert all(int(s) % seq_len == 0 and int(s) + seq_len < n for s in x[:, 0])
    assert np.array_equal(y[:, :-1], x[:, 1:]) and bool((x[:, 1:] - x[:, :-1] == 1).all())


def test_eval_blocks_holds_out_the_asked_share_at_1e10_tokens():
    block, is_eval = eval_blocks(10**10, 0.02, 2048)
    assert block == 2048 and is_eval.size == -(-10**10 // 2048)
    assert abs(int(is_eval.sum()) - 0.02 * is_eval.size) <= 1
    assert set(np.diff(np.flatnonzero(is_eval)).tolist()) == {50}


def test_split_writer_records_document_ends_past_2_to_the_32(tmp_path):
    """Document ends are uint64 offsets into the split, exact past 2^32."""
    base = (1 << 33) + 11
    with SplitWriter(tmp_path, "train", eos_id=0) as w:
        w.num_tokens = w._last_end = base  # as if 2^33 + 11 tokens, ending a document, were written before
        w.write(np.array([5, 0, 6, 6, 0, 7], dtype=np.uint32))
        assert w.finish() == (base + 6, 3)
    assert np.fromfile(tmp_path / "train.docs.u64", dtype="<u8").tolist() == [base + 2, base + 5, base + 6]


@pytest.mark.parametrize("eval_fraction", [1e-7, 4e-7, 1 - 1e-7])
def test_an_eval_fraction_that_rounds_to_no_block_is_refused_before_tokenizing(tmp_path, eval_fraction):
    """In (0, 1) but counted in millionths: below 5e-7 it rounds to 0 (or to 1 near 1), and the split divided by
    zero after the BPE was trained (`moe-train train --data.eval_fraction=1e-7` on the embedded corpus too)."""
    with pytest.raises(DataError, match=rf"eval_fraction={eval_fraction!r}: expected between 1e-06 and 1 - 1e-06"):
        eval_blocks(10**6, eval_fraction, 2048)
    with pytest.raises(DataError, match="expected between 1e-06 and 1 - 1e-06"):
        prepare_data(["def f():\n    return 1\n"] * 20, tmp_path / "data", vocab_size=300, eval_fraction=eval_fraction)
    assert list(tmp_path.iterdir()) == []
    assert eval_blocks(10**6, 1e-6, 2048)[1].sum() == 1  # the smallest share that counts: one block


def test_prepare_data_memory_does_not_grow_with_a_3x_corpus_of_many_files(tmp_path, data_dir):
    """The streaming claim, through the CLI with a given tokenizer.json (one prepare-data wrote): 3x the text (8 -> 24
    MB in ~25 KB files, non-ASCII included; 17.6M tokens) adds less than 24 MB to the peak RSS, 1.5 bytes a byte of
    added text (measured: +3 to +15 MB; holding the stream's uint32 tokens in memory adds ~47 MB). Below ~8 MB the
    peak is still rising to its level (+20 to +40 MB from 2 to 4 MB), so the smaller corpus is 8 MB."""
    tokenizer = str(data_dir / "tokenizer.json")
    small, large = corpus_files(tmp_path / "small", 8), corpus_files(tmp_path / "large", 24)
    a = prepare_peak_rss(tmp_path, small, tokenizer)["rss_mb"]
    b = prepare_peak_rss(tmp_path, large, tokenizer)["rss_mb"]
    assert b - a < 24, f"prepare-data --tokenizer: {a:.0f} MB peak RSS on 8 MB of text, {b:.0f} MB on 24 MB"


@pytest.mark.parametrize("eval_fraction", ["1e-7", "0.9999999"])
def test_train_refuses_such_an_eval_fraction_by_its_flag_before_any_work(tmp_path, capsys, eval_fraction):
    from moe_train.cli import main

    assert main(["train", f"--data.eval_fraction={eval_fraction}", f"--train.run_dir={tmp_path / 'run'}",
                 f"--data.cache_dir={tmp_path / 'cache'}"]) == 2
    assert (f"data.eval_fraction={float(eval_fraction)!r}: expected between 1e-06 and 1 - 1e-06"
            in capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []
