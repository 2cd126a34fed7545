import json

import numpy as np
import pytest
import torch

from moe_train.data import DataError, WindowSampler, eval_windows, open_data, prepare_data


def test_prepare_writes_uint32_tokens_with_document_boundaries(data_dir):
    meta, splits = open_data(data_dir, 512)
    train = splits["train"]
    assert train.tokens.dtype == np.uint32 and train.tokens.size == meta["splits"]["train"]["num_tokens"]
    ends = train.doc_ends.astype(np.int64)
    assert ends[-1] == train.tokens.size and np.all(np.diff(ends) > 0)
    assert np.all(train.tokens[ends - 1] == meta["eos_id"])
    assert (data_dir / "tokenizer.json").is_file()


def test_data_of_a_larger_vocab_is_refused_before_its_tokens_are_read(data_dir, monkeypatch):
    from moe_train.data import token_file

    def no_scan(tokens, chunk=0):  # noqa: ANN001, ANN202
        raise AssertionError("the tokens were scanned before the meta.json check")
    monkeypatch.setattr(token_file, "_chunked_max", no_scan)
    with pytest.raises(DataError, match=r"tokenized with vocab_size=512, larger than model.vocab_size=100.*"
                                        r"--model.vocab_size=512"):
        open_data(data_dir, 100)


def test_token_ids_beyond_model_vocab_are_refused(data_dir):
    """A meta.json whose vocab_size is below the ids its splits record (ids 0..511, vocab_size edited to 100) is
    refused naming the record, before any token is read; with no record, the scan finds them."""
    meta = json.loads((data_dir / "meta.json").read_text())
    meta["vocab_size"] = 100
    (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"splits.train.max_token_id=511 >= its vocab_size=100: meta.json does not "
                                        r"hold together"):
        open_data(data_dir, 100)
    for split in meta["splits"].values():
        del split["max_token_id"]
    (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"token id 511 >= model.vocab_size=100"):
        open_data(data_dir, 100)


def test_truncated_or_missing_data_is_refused(tmp_path, data_dir):
    with pytest.raises(DataError, match="does not exist"):
        open_data(tmp_path / "nope", 512)
    raw = (data_dir / "train.u32").read_bytes()
    (data_dir / "train.u32").write_bytes(raw[:-2])
    with pytest.raises(DataError, match="not a multiple of 4"):
        open_data(data_dir, 512)


def test_sampler_is_deterministic_and_resumes_exactly():
    tokens = np.arange(1000, dtype=np.uint32)
    a = WindowSampler(tokens, 16, seed=3)
    first = [a.next_batch(4) for _ in range(5)]
    b = WindowSampler(tokens, 16, seed=3)
    b.next_batch(4), b.next_batch(4)
    c = WindowSampler(tokens, 16, seed=3)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    for want in first[2:]:
        got = c.next_batch(4)
        assert all(np.array_equal(w, g) for w, g in zip(want, got))
    x, y = first[0]
    assert np.array_equal(x[:, 1:], y[:, :-1])


def test_sampler_ranks_split_the_global_batch():
    tokens = np.arange(2000, dtype=np.uint32)
    whole = WindowSampler(tokens, 10, seed=1).next_batch(6)[0]
    parts = [WindowSampler(tokens, 10, seed=1).next_batch(3, rank=r, world=2)[0] for r in range(2)]
    assert sorted(map(tuple, whole.tolist())) == sorted(map(tuple, (parts[0].tolist() + parts[1].tolist())))


def test_eval_windows_and_their_average_do_not_depend_on_the_batch_size():
    """The same windows for any batch size, and batch means weighted by batch size give the mean over windows."""
    tokens = np.arange(1000, dtype=np.uint32)
    ref = eval_windows(tokens, 16, 12, 1)
    ref_x = torch.cat([x for x, _ in ref])
    for max_batch in (2, 5, 7, 12, 64):
        got = eval_windows(tokens, 16, 12, max_batch)
        assert [x.shape[0] for x, _ in got] == [min(max_batch, 12 - b) for b in range(0, 12, max_batch)]
        assert torch.equal(torch.cat([x for x, _ in got]), ref_x)
        weighted = sum(x.double().mean() * x.shape[0] for x, _ in got) / 12
        assert torch.allclose(weighted, ref_x.double().mean())
    assert eval_windows(tokens[:5], 16, 12, 4) == []  # fewer tokens than one window: no eval set


def test_prepare_with_a_given_tokenizer(tmp_path, data_dir):
    out = prepare_data(["def f():\n    return 1\n"] * 5, tmp_path / "d2", tokenizer_path=str(data_dir / "tokenizer.json"))
    meta, _ = open_data(out, 512)
    assert meta["vocab_size"] == 512


def test_prepare_refuses_to_replace_a_folder_that_is_not_a_data_folder(tmp_path, data_dir):
    """--out replaces its target whole: only a new folder or an earlier data folder may be it."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("keep")
    docs = ["def f():\n    return 1\n"] * 5
    with pytest.raises(DataError, match="exists and is not a data folder"):
        prepare_data(docs, precious, tokenizer_path=str(data_dir / "tokenizer.json"))
    assert (precious / "thesis.txt").read_text() == "keep"
    out = prepare_data(docs, tmp_path / "d", tokenizer_path=str(data_dir / "tokenizer.json"))
    prepare_data(docs * 2, out, tokenizer_path=str(data_dir / "tokenizer.json"))  # an earlier data folder: replaced
    with pytest.raises(DataError, match="no documents"):
        prepare_data([], tmp_path / "e")
    with pytest.raises(FileNotFoundError):
        prepare_data(docs, tmp_path / "f", tokenizer_path=str(tmp_path / "missing.json"))
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]  # nothing half-written left behind


def test_bpe_cuts_long_unbroken_runs_and_leaves_ordinary_text_alone():
    """BPE training is quadratic in a word's length: one long unbroken line (minified code, base64)
    is cut into pieces of at most MAX_WORD_CHARS before training; ordinary text splits as plain
    byte-level BPE does, and text round-trips exactly."""
    from tokenizers import pre_tokenizers

    from moe_train.data.prepare import MAX_WORD_CHARS, train_bpe

    line = "".join("abcdefghij"[(i * 7919) % 10] for i in range(20_000))
    text = "def f(x):\n    return x ** 2  # square\n\n" + line + " tail"
    tok = train_bpe([text], 300)
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
    assert max(len(p) for p in pieces) <= MAX_WORD_CHARS
    ordinary = "Hello world,  this is a   test of def f(x): return x**2 # ok\n\tdone"
    assert tok.pre_tokenizer.pre_tokenize_str(ordinary) == pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(ordinary)
    assert tok.decode(tok.encode(text).ids) == text
