"""Token ids beyond the model's vocabulary: a data folder records each split's largest id (prepare-data, since
0.16.0), so opening it reads no token; an older folder is scanned as before; and every window drawn for training or
eval is checked, so a token file changed after its meta.json was written stops with an error naming the file and
the token, not with an embedding index past its table (a device-side assert on a GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_train.data import DataError, WindowSampler, eval_windows, open_data
from moe_train.data import token_file


def test_prepare_data_records_each_splits_largest_token_id(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    for name in ("train", "eval"):
        tokens = np.fromfile(data_dir / f"{name}.u32", dtype="<u4")
        assert meta["splits"][name]["max_token_id"] == int(tokens.max()), name


def test_a_folder_that_records_its_largest_id_opens_without_reading_its_tokens(data_dir, monkeypatch):
    def no_scan(tokens, chunk=0):  # noqa: ANN001, ANN202
        raise AssertionError("open_data read every token although meta.json records the largest id")
    monkeypatch.setattr(token_file, "_chunked_max", no_scan)
    meta, splits = open_data(data_dir, 512)
    assert splits["train"].tokens.size == meta["splits"]["train"]["num_tokens"]
    top = meta["splits"]["train"]["max_token_id"]
    meta["vocab_size"] = top  # the recorded id alone (no token read) says the model of `top` cannot embed it
    (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"splits.train.max_token_id={top} >= its vocab_size={top}: meta.json does "
                                        r"not hold together .*prepare the data again$"):
        open_data(data_dir, top)


def test_a_folder_from_before_the_record_is_scanned(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    for split in meta["splits"].values():
        del split["max_token_id"]
    meta["vocab_size"] = 100
    (data_dir / "meta.json").write_text(json.dumps(meta))
    # the folder's own vocabulary is the model's: the advice is to prepare the data again (before moe-train 0.27.24,
    # "set model.vocab_size >= id + 1", which would train on the damage; review helper 162)
    with pytest.raises(DataError, match=r"train.u32: token id \d+ >= model.vocab_size=100, past the folder's own "
                                        r"vocabulary too \(meta.json: vocab_size=100; found by a scan of the "
                                        r"split\): the token file and its meta.json no longer match .*; prepare "
                                        r"the data again$"):
        open_data(data_dir, 100)


def test_a_vocabulary_larger_than_the_models_names_both_ways_out_and_which_folders_the_flag_helps(data_dir):
    """--vocab-size only shapes a BPE prepare-data trains; a --tokenizer brings its own vocabulary (before 0.27.26
    the advice was "prepare the data with --vocab-size N" alone, whatever made the folder)."""
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    with pytest.raises(DataError, match=rf"vocab_size={vocab}, larger than model.vocab_size=100: .* set "
                                        rf"model.vocab_size >= {vocab} \(e.g. --model.vocab_size={vocab}\), or "
                                        r"tokenize the data with a vocabulary of at most 100 ids \(`moe-train "
                                        r"prepare-data --vocab-size 100` trains one; a --tokenizer brings its own\)$"):
        open_data(data_dir, 100)


def test_open_data_without_a_model_bounds_an_unrecorded_split_by_its_meta_json(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    for split in meta["splits"].values():
        del split["max_token_id"]
    (data_dir / "meta.json").write_text(json.dumps(meta))
    _, splits = open_data(data_dir, None)
    assert splits["train"].id_bound == splits["eval"].id_bound == meta["vocab_size"]
    _, splits = open_data(data_dir, meta["vocab_size"] + 50)  # a model's: as before 0.27.25 for such a folder
    assert splits["train"].id_bound == meta["vocab_size"] + 50


def poison(path, at: int, value: int) -> None:
    tokens = np.fromfile(path, dtype="<u4")
    tokens[at] = value
    tokens.tofile(path)


def test_a_token_file_changed_after_its_meta_is_caught_when_its_window_is_drawn(data_dir):
    poison(data_dir / "train.u32", 1000, 70_000)  # meta.json still records the old largest id
    _, splits = open_data(data_dir, 512)
    sampler = WindowSampler(splits["train"].tokens, 32, seed=0, shuffle=False, vocab_size=512)
    for _ in range(1000 // 33):  # the windows before it are fine
        sampler.next_batch(1)
    # not "set model.vocab_size >= 70001", which helper 160 found on a damaged file whose meta.json matched the model
    with pytest.raises(DataError, match=r"train.u32 at token 1000: token id 70000 >= vocab_size=512, the split's "
                                        r"bound when the run opened it .*, though the split passed the id check then "
                                        r".*: the token file and its meta.json no "
                                        r"longer match .*; prepare the data again$"):
        for _ in range(3):
            sampler.next_batch(1)


def test_an_eval_split_changed_after_its_meta_is_caught_when_the_eval_set_is_built(data_dir):
    poison(data_dir / "eval.u32", 5, 9_999)
    _, splits = open_data(data_dir, 512)
    with pytest.raises(DataError, match=r"eval.u32 at token 5: token id 9999 >= vocab_size=512"):
        eval_windows(splits["eval"].tokens, 32, 8, 4, vocab_size=512)


def test_the_trainer_checks_the_windows_it_draws(tmp_path, data_dir, make_config):
    from moe_train.trainer.loop import Trainer

    tokens = np.fromfile(data_dir / "train.u32", dtype="<u4")
    tokens[:] = np.minimum(tokens, 511)
    tokens[::50] = 600  # every window holds one; meta.json says otherwise
    tokens.tofile(data_dir / "train.u32")
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    with pytest.raises(DataError, match=r"train.u32 at token \d+: token id 600 >= vocab_size=512"):
        Trainer(cfg).train()


def test_ids_past_the_datas_vocabulary_but_below_the_models_are_refused(tmp_path, data_dir, make_config):
    """A model larger than its data's vocabulary (model.vocab_size 512, a 300-token tokenizer): an id in [300, 512)
    is one the tokenizer cannot emit, so a token file holding one was damaged after prepare-data. Before moe-train
    0.27.25 only ids >= model.vocab_size were refused, and such damage trained silently (review helper 162)."""
    from moe_train.trainer.loop import Trainer

    bound = 300  # the data's vocabulary: its ids clamped below it, as a 300-token tokenizer would emit them
    meta = json.loads((data_dir / "meta.json").read_text())
    for name in ("train", "eval"):
        split = np.minimum(np.fromfile(data_dir / f"{name}.u32", dtype="<u4"), bound - 1)
        split.tofile(data_dir / f"{name}.u32")
        meta["splits"][name]["max_token_id"] = int(split.max())
    meta["vocab_size"] = bound
    (data_dir / "meta.json").write_text(json.dumps(meta))
    _, splits = open_data(data_dir, 512)
    assert splits["train"].id_bound == splits["eval"].id_bound == bound

    tokens = np.fromfile(data_dir / "train.u32", dtype="<u4")
    tokens[::50] = bound  # damaged after meta.json was written: caught when the trainer draws its window
    tokens.tofile(data_dir / "train.u32")
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    assert cfg.model.vocab_size == 512
    with pytest.raises(DataError, match=rf"train.u32 at token \d+: token id {bound} >= vocab_size={bound}, the split"):
        Trainer(cfg).train()


def test_a_folder_whose_recorded_ids_pass_its_vocab_size_is_refused_naming_the_cause(data_dir):
    """moe-train 0.16.0-0.19.3 wrote a tokenizer's token count as vocab_size, short of its largest id + 1 where ids
    skip, and prepare-data before 0.27.25 left out ids a post-processor adds (review helper 166): such a meta.json
    records a largest id >= its vocab_size. It is refused at open naming that, not at a drawn window as a damaged
    token file; taking the recorded ids as the vocabulary instead (tried on review) told a user whose max_token_id
    was damaged to raise model.vocab_size to 2**32 (helper 168). A folder without the record (before 0.16.0) is
    bounded by the model's vocabulary alone, as before."""
    meta = json.loads((data_dir / "meta.json").read_text())
    top = meta["splits"]["train"]["max_token_id"]
    meta["vocab_size"] = top - 10
    (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"splits.train.max_token_id={top} >= its vocab_size={top - 10}: meta.json "
                                        r"does not hold together \(moe-train before 0.19.4 .*prepare the data again$"):
        open_data(data_dir, 4096)
    for split in meta["splits"].values():
        del split["max_token_id"]
    (data_dir / "meta.json").write_text(json.dumps(meta))
    _, splits = open_data(data_dir, 4096)
    assert splits["train"].id_bound == splits["eval"].id_bound == 4096


def test_prepare_data_counts_the_ids_a_post_processor_adds(tmp_path):
    """A tokenizer whose post-processor adds a special token outside its vocabulary (id 5000 on a 4-token WordLevel):
    meta.json's vocab_size covers it, so the train command prepare-data prints embeds it (before 0.27.25: vocab_size=4,
    and the folder was refused at every model size; review helper 166)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from moe_train.data import prepare_data

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    tok.add_special_tokens(["<|endoftext|>"])  # an end token only a document's end produces (0.27.27 refuses a word)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 5000)])
    tok.save(str(tmp_path / "tok.json"))
    docs = ["a b a b", "b a", "a a b b a"] * 50
    out = prepare_data(docs, tmp_path / "data", tokenizer_path=str(tmp_path / "tok.json"))
    meta = json.loads((out / "meta.json").read_text())
    assert max(split["max_token_id"] for split in meta["splits"].values()) == 5000
    assert meta["vocab_size"] == 5001
    open_data(out, 5001)
