"""`moe-train inspect DATA`: a data folder prepare-data wrote is described (source, tokenizer, each split's tokens,
documents, largest id and digest, the command that trains on it), opened as a run opens it, so a damaged one is
refused naming the file."""

from __future__ import annotations

import json

import numpy as np

from moe_train.cli import main


def test_inspect_describes_a_data_folder_with_the_numbers_its_meta_json_records(data_dir, capsys):
    meta = json.loads((data_dir / "meta.json").read_text())
    assert main(["inspect", str(data_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"data folder {data_dir} (moe-train-tokens/1")
    assert out[1] == "source: stdlib-test"
    assert out[2] == f"tokenizer: tokenizer.json, vocab_size={meta['vocab_size']}, eos_id={meta['eos_id']}"
    for line, name in zip(out[3:5], ("train", "eval")):
        split = meta["splits"][name]
        docs = split["num_docs"]
        assert line == (f"{name}: {split['num_tokens']:,} tokens, {docs:,} document{'' if docs == 1 else 's'}, "
                        f"largest id {split['max_token_id']}, digest {split['digest'][:20]}…")
    assert out[5] == f"train on it: moe-train train --data.path={data_dir} --model.vocab_size={meta['vocab_size']}"


def test_inspect_of_a_folder_from_before_digests_counts_its_documents_from_the_ends_file(data_dir, capsys):
    meta = json.loads((data_dir / "meta.json").read_text())
    for split in meta["splits"].values():
        for key in ("digest", "num_docs", "max_token_id"):
            del split[key]
    (data_dir / "meta.json").write_text(json.dumps(meta))
    assert main(["inspect", str(data_dir)]) == 0
    train = capsys.readouterr().out.splitlines()[3]
    docs = np.fromfile(data_dir / "train.docs.u64", dtype="<u8").size
    assert train == (f"train: {meta['splits']['train']['num_tokens']:,} tokens, {docs:,} documents, "
                     "largest id (not recorded), digest (not recorded)")


def test_inspect_refuses_a_data_folder_whose_token_file_is_truncated_naming_it(data_dir, capsys):
    path = data_dir / "train.u32"
    path.write_bytes(path.read_bytes()[:-4])
    assert main(["inspect", str(data_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: holds" in err and "but meta.json says" in err and "truncated" in err


def test_inspect_of_a_folder_with_neither_checkpoint_nor_data_names_both(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no data (no meta.json)" in err and "a data folder (with meta.json)" in err


def test_inspect_of_an_unrecorded_folder_with_an_id_past_its_vocabulary_names_meta_json_not_a_model(data_dir, capsys):
    """inspect has no model: the bound it names is meta.json's vocab_size (before 0.27.26 it said
    "model.vocab_size=V, past the folder's own vocabulary too")."""
    meta = json.loads((data_dir / "meta.json").read_text())
    for split in meta["splits"].values():
        del split["max_token_id"]  # a folder from before moe-train 0.16.0: its splits are scanned
    (data_dir / "meta.json").write_text(json.dumps(meta))
    tokens = np.fromfile(data_dir / "train.u32", dtype="<u4")
    tokens[7] = meta["vocab_size"] + 3
    tokens.tofile(data_dir / "train.u32")
    assert main(["inspect", str(data_dir)]) == 2
    err = capsys.readouterr().err
    assert (f"train.u32: token id {meta['vocab_size'] + 3} >= meta.json's vocab_size={meta['vocab_size']}, found by "
            "a scan of the split") in err, err
    assert "model.vocab_size" not in err and "prepare the data again" in err, err
