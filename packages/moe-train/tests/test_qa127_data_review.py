"""QA 127: moe-train 0.21.22 -> 0.21.28's data path and CLI tried with inputs its authors did not try: the uint32
epoch order at its bound and at every resume point, the eval split against the documented block rule, an
eval_fraction of numpy's float32, a --eval-fraction that leaves a split shorter than a window, and inspect on a
meta.json whose recorded values open_data does not use."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from fractions import Fraction

import numpy as np
import pytest

import moe_train.data.prepare as prepare
import moe_train.data.sampler as sampler_module
from moe_train.cli import main
from moe_train.data import DataError, WindowSampler, open_data
from moe_train.data.prepare import eval_blocks


class Positions:
    """A token stream of `size` tokens whose token at position i is i (never materialised)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __getitem__(self, s: slice) -> np.ndarray:
        return np.arange(s.start, min(s.stop, self.size), dtype=np.int64)


# --- defects -------------------------------------------------------------------------------------------------------

def test_prepare_data_takes_an_eval_fraction_of_numpy_float32(tmp_path):
    """Fraction() refuses numpy's float32 ("argument should be a string or a Rational instance", naming nothing):
    prepare_data(eval_fraction=np.float32(...)) failed so, where a Python float of the same value works."""
    block, is_eval = eval_blocks(100_000, np.float32(0.25), 2048)
    assert (block, int(is_eval.sum()), is_eval.size) == (2048, 12, 49)
    with pytest.raises(DataError, match=r"eval_fraction=(np\.float32\()?1e-07\)?: expected between 1e-06"):
        prepare.prepare_data(["some text"], tmp_path / "out", eval_fraction=np.float32(1e-7))
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (folder / f"doc{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(40)))
    return folder


@pytest.mark.parametrize("fraction, split", [("1e-6", "eval"), ("0.9999994", "train")])
def test_prepare_data_warns_when_a_split_is_shorter_than_the_window_of_the_command_it_prints(tmp_path, corpus, capsys,
                                                                                            fraction, split):
    """A small --eval-fraction on a small corpus holds out one token (the last block, a token long); prepare-data said
    nothing and printed `train on it: moe-train train ...`, which then stopped at start-up ("the eval split has 1
    tokens, fewer than one window")."""
    out = tmp_path / "data"
    args = ["prepare-data", str(corpus), "--out", str(out), "--vocab-size", "300", "--eval-fraction", fraction]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert f"the {split} split holds 1 token, fewer than one window of data.seq_len+1=129" in captured.err
    assert f"--eval-fraction (it was {float(fraction)!r})" in captured.err
    command = captured.out.splitlines()[-1].removeprefix("train on it: moe-train ").split()
    assert main(command + [f"--train.run_dir={tmp_path / 'run'}"]) == 2  # the run it warned of
    assert re.search(rf"the {split} split (\(.*\) )?has 1 token, fewer than one window", capsys.readouterr().err)
    assert f"{'1 train token (' if split == 'train' else ', 1 eval token ('}" in captured.out  # not "1 eval tokens"


def test_inspect_warns_of_a_split_shorter_than_the_window_of_the_command_it_prints(tmp_path, corpus, capsys):
    """inspect prints the same `train on it` command; it said `eval: 1 tokens` and nothing of the run stopping."""
    out = tmp_path / "data"
    assert main(["prepare-data", str(corpus), "--out", str(out), "--vocab-size", "300", "--eval-fraction", "1e-6"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    captured = capsys.readouterr()
    assert "eval: 1 token, 1 document, largest id 0" in captured.out
    assert ("the eval split holds 1 token, fewer than one window of data.seq_len+1=129: a run on it stops before its "
            "first step; prepare it with a larger --eval-fraction or more text") in captured.err


def test_prepare_data_and_inspect_name_both_splits_when_both_are_short(tmp_path, capsys):
    """A one-line corpus: both splits are shorter than a window. Only the train split was named (review helper 151),
    and its suggested fix then stopped the run on the eval split."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "one.txt").write_text("a tiny corpus\n")
    out = tmp_path / "data"
    assert main(["prepare-data", str(tmp_path / "c"), "--out", str(out), "--vocab-size", "300"]) == 0
    assert main(["inspect", str(out)]) == 0
    err = capsys.readouterr().err
    for split in ("train", "eval"):
        assert err.count(f"the {split} split holds ") == 2, err


def test_prepare_data_does_not_warn_where_both_splits_hold_a_window(tmp_path, corpus, capsys):
    assert main(["prepare-data", str(corpus), "--out", str(tmp_path / "d"), "--vocab-size", "300",
                 "--eval-fraction", "0.3"]) == 0
    assert "split holds" not in capsys.readouterr().err


def test_inspect_shows_no_recorded_value_that_open_data_did_not_use(data_dir, capsys):
    """open_data reads a split whose recorded max_token_id is no token id (true, 2^40) and counts documents from
    docs.u64 where num_docs is none (-3); inspect printed those values as they stood: `largest id True`,
    `-3 documents`."""
    meta = json.loads((data_dir / "meta.json").read_text())
    meta["splits"]["train"].update(max_token_id=True, num_docs=-3)
    meta["splits"]["eval"]["max_token_id"] = 2**40
    (data_dir / "meta.json").write_text(json.dumps(meta))
    assert main(["inspect", str(data_dir)]) == 0
    train, held_out = capsys.readouterr().out.splitlines()[3:5]
    docs = np.fromfile(data_dir / "train.docs.u64", dtype="<u8").size
    assert f"{docs:,} documents, largest id (meta.json's True is not a token id)" in train
    assert f"largest id (meta.json's {2**40} is not a token id)" in held_out


# --- guards: what was right --------------------------------------------------------------------------------------

class _ArangeRecorder:
    """Stands in for numpy in sampler.py: records the length and dtype each epoch's order is built in, and builds a
    3-window one (2^32 windows would be 16 GB)."""

    def __init__(self) -> None:
        self.built: list[tuple[int, np.dtype]] = []

    def __getattr__(self, name: str):
        return getattr(np, name)

    def arange(self, n: int, dtype) -> np.ndarray:
        self.built.append((n, np.dtype(dtype)))
        return np.arange(3, dtype=dtype)


def test_the_epoch_order_is_uint32_up_to_exactly_2_to_the_32_windows_and_int64_past(monkeypatch):
    """A uint32 arange past 2^32 wraps silently (as uint8's does past 256), repeating windows 0, 1, ...: the order
    must widen exactly where window numbers stop fitting."""
    assert np.arange(257, dtype=np.uint8)[-1] == 0  # the wrap a too-narrow order would make
    recorder = _ArangeRecorder()
    monkeypatch.setattr(sampler_module, "np", recorder)
    for windows in (2**32 - 1, 2**32, 2**32 + 1):
        WindowSampler(Positions(windows + 1), 1, seed=0)._epoch_order(0)
    assert recorder.built == [(2**32 - 1, np.dtype(np.uint32)), (2**32, np.dtype(np.uint32)),
                              (2**32 + 1, np.dtype(np.int64))]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_resume_at_every_step_over_three_epochs_reads_each_epochs_reference_permutation(world):
    """Windows 7, micro-batch 2: global batches straddle epoch ends. Whatever step the run resumes at, rank r's rows
    are global draws base + j*world + r of the concatenated default_rng([seed, e]).permutation(7)."""
    windows, seq_len, seed, micro = 7, 3, 11, 2
    tokens = Positions(windows * seq_len + 2)
    reference = np.concatenate([np.random.default_rng([seed, e]).permutation(windows) for e in range(4)])
    steps = 3 * windows // (micro * world) + 1
    for resume_at in range(steps):
        ranks = [WindowSampler(tokens, seq_len, seed) for _ in range(world)]
        drawn = []
        for step in range(steps):
            if step == resume_at:
                state = json.loads(json.dumps(ranks[0].state_dict()))
                ranks = [WindowSampler(tokens, seq_len, seed) for _ in range(world)]
                for s in ranks:
                    s.load_state_dict(state)
            rows = [s.next_batch(micro, r, world)[0][:, 0] // seq_len for r, s in enumerate(ranks)]
            drawn += [int(rows[r][j]) for j in range(micro) for r in range(world)]
        assert drawn == reference[: len(drawn)].tolist(), resume_at


def test_the_eval_split_is_the_documented_blocks_whatever_the_chunk_and_block_sizes(tmp_path, monkeypatch):
    """README/eval_blocks: block i is held out when floor((i+1+c)p/q) passes an integer, c = ceil(q/2p) - 1 (the last
    block where none is); train and eval are the stream's kept and held-out blocks in order, each document end
    recorded, across split chunks that cut blocks anywhere."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(2, 6000))
        fraction = float(rng.choice([0.02, 0.3, 0.5, 0.9, 1e-6, 1 / 3, 0.0101]))
        monkeypatch.setattr(prepare, "SPLIT_CHUNK_TOKENS", int(rng.integers(1, 3000)))
        stream = np.arange(1, n + 1, dtype="<u4")
        stream[rng.random(n) < 0.05] = 0  # eos_id 0
        folder = tmp_path / str(trial)
        folder.mkdir()
        stream.tofile(folder / "stream.u32")
        try:
            block, splits = prepare._split_stream_file(folder / "stream.u32", n, folder, fraction, 0)
        except DataError:
            continue  # too few tokens to hold out a block: refused, as documented
        p, q = Fraction(fraction).limit_denominator(10**6).as_integer_ratio()
        c, i = -(-q // (2 * p)) - 1, np.arange(-(-n // block))
        rule = (i + 1 + c) * p // q > (i + c) * p // q
        rule[-1] |= not rule.any()
        held = np.repeat(rule, block)[:n]
        for name, want in (("train", stream[~held]), ("eval", stream[held])):
            assert np.array_equal(np.fromfile(folder / f"{name}.u32", dtype="<u4"), want), (trial, name)
            ends = np.flatnonzero(want == 0) + 1
            ends = np.append(ends, want.size) if want.size and (not ends.size or ends[-1] != want.size) else ends
            assert np.array_equal(np.fromfile(folder / f"{name}.docs.u64", dtype="<u8"), ends), (trial, name)
            assert splits[name]["num_docs"] == ends.size and splits[name]["num_tokens"] == want.size


def test_document_ends_that_are_empty_missing_or_cut_open_as_np_fromfile_read_them(data_dir):
    """docs.u64 is mapped since 0.21.23; it was read with np.fromfile: an empty file is no document, a partial last
    entry is left out, no file is one document, the whole split. Training never reads it."""
    ends = data_dir / "train.docs.u64"
    whole = np.fromfile(ends, dtype="<u8")
    ends.write_bytes(whole[:2].tobytes() + b"\x01\x02\x03")
    _, splits = open_data(data_dir, 512)
    assert splits["train"].doc_ends.tolist() == whole[:2].tolist()
    ends.write_bytes(b"")
    assert open_data(data_dir, 512)[1]["train"].doc_ends.size == 0
    ends.unlink()
    _, splits = open_data(data_dir, 512)
    assert splits["train"].doc_ends.tolist() == [splits["train"].tokens.size]


def test_inspect_quotes_a_data_path_with_spaces_and_unicode_in_the_command_it_prints(data_dir, capsys):
    odd = shutil.move(str(data_dir), str(data_dir.parent / "my data ü"))
    assert main(["inspect", odd]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"data folder {odd} (")
    assert f"--data.path={odd}" in shlex.split(out[-1])


def test_eval_fractions_that_hold_out_other_blocks_get_other_default_folders():
    """The embedded corpus's cache folder was named with eval_fraction:g (6 significant digits): 1.5e-05 and
    1.500004e-05 hold out other blocks and shared one folder, so the second run reused the first one's split."""
    from moe_train.config import DataConfig
    from moe_train.data.prepare import eval_blocks
    from moe_train.trainer.data_setup import default_data_dir

    a, b = 1.5e-05, 1.500004e-05
    assert not np.array_equal(eval_blocks(10**6, a, 2048)[1], eval_blocks(10**6, b, 2048)[1])
    assert default_data_dir(DataConfig(eval_fraction=a)) != default_data_dir(DataConfig(eval_fraction=b))
    assert default_data_dir(DataConfig(eval_fraction=a)).name.endswith("-e1.5e-05")  # names as before where :g was exact


def test_a_file_this_user_may_not_read_is_one_error_line_naming_it(tmp_path, corpus, capsys, monkeypatch):
    """An unreadable meta.json (or any path the user gave, unreadable or unwritable) ended in a PermissionError
    traceback; now one `moe-train: error:` line naming the file, exit status 2 (checked by raising the error the
    read gives: the tests may run as root, whom file modes do not stop)."""
    out = tmp_path / "data"
    assert main(["prepare-data", str(corpus), "--out", str(out), "--vocab-size", "300"]) == 0
    capsys.readouterr()
    real = Path.read_text

    def read_text(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self.name == "meta.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", read_text)
    assert main(["inspect", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"moe-train: error: [Errno 13] Permission denied: '{out / 'meta.json'}'\n"
