"""QA pass 47: Hugging Face export inputs that gave a folder transformers cannot use, or a bare traceback, are refused
by name before anything is written: a tokenizer with ids past the model's vocabulary, extra_config keys config.json
never gets and token ids no embedding row holds, a max_shard_bytes that is no byte count, a model dict missing a
field. The inputs that are fine still export to folders transformers loads and runs."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from moe_ckpt.hf import HFConversionError, export_hf_folder
from moe_ckpt.hf.layout import build_plan

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

QWEN3_MOE = dict(  # moe-train's model fields: a tiny Qwen3-MoE (softmax, per-head QK-norm, no shared expert)
    vocab_size=40, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=None, qk_norm=True,
    attention_bias=False, rope_theta=500.0, rotary_fraction=1.0, norm_eps=1e-6, dense_hidden=48, dense_layers=[],
    num_experts=4, expert_hidden=16, shared_expert_hidden=0, shared_expert_gate=False, tie_embeddings=False,
    init_std=0.02, router=dict(gating="softmax", top_k=2, normalize_top_k=True, routing="learned", expert_bias=False,
                               routed_scaling_factor=1.0))
WORDS = [f"w{i}" for i in range(60)]  # 60 ordinary tokens after <eos> and <unk>: ids up to 61


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def source(m: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {e.ours: 0.1 * torch.randn(e.our_shape, generator=g) for e in build_plan(m, "qwen3_moe") if e.ours}


def write_tokenizer(path, kind: str, words: list[str]) -> int:
    """A real tokenizers tokenizer.json (<eos> id 0, <unk> id 1, then `words`); its largest id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if kind == "word_level":  # model.vocab is a {token: id} object (as BPE's and WordPiece's)
        vocab = {t: i for i, t in enumerate(["<eos>", "<unk>", *words])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    else:  # unigram: model.vocab is a [[token, score], ...] list, ids by position
        tok = Tokenizer(models.Unigram([("<eos>", 0.0), ("<unk>", 0.0), *((w, -1.0) for w in words)], unk_id=1))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path))
    return tok.get_vocab_size() - 1


def folder_files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("kind", ["word_level", "unigram"])
def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused_before_anything_is_written(kind, tmp_path):
    """Before, a tokenizer of 62 ids shipped with a 40-row model: AutoTokenizer encoded 'w50' as 52 and the model
    failed on it ('index out of range in self'). A tokenizer that fits still exports, and its text generates."""
    big = tmp_path / "big" / "tokenizer.json"
    big.parent.mkdir()
    largest = write_tokenizer(big, kind, WORDS)
    m = dict(QWEN3_MOE)
    read = []

    def lazy(name: str) -> torch.Tensor:
        read.append(name)
        return source(m)[name]

    refused = (rf"tokenizer_json=.*has token ids up to {largest}, but model.vocab_size=40: "
               r".*expected a tokenizer whose ids are all below 40")
    with pytest.raises(HFConversionError, match=refused):
        export_hf_folder(m, lazy, tmp_path / "hf", tokenizer_json=big, extra_config={"eos_token_id": 0})
    assert read == [] and folder_files(tmp_path) == ["big", "big/tokenizer.json"]

    fits = tmp_path / "fits.json"
    write_tokenizer(fits, kind, WORDS[:38])  # ids 0..39
    export_hf_folder(m, source(m), tmp_path / "hf", tokenizer_json=fits, dtype="fp32",
                     extra_config={"eos_token_id": 0})
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = tok("w3 w37 w0", return_tensors="pt").input_ids
    assert ids.tolist() == [[5, 39, 2]] and tok.eos_token == "<eos>"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and out.shape[1] >= 4 and int(out.max()) < 40


@pytest.mark.parametrize(("extra", "message"), [
    ({"eos_id": 3}, r"extra_config key 'eos_id'=3: expected only max_position_embeddings, bos_token_id, eos_token_id"),
    ({"eos_token": "<eos>"}, r"extra_config key 'eos_token'='<eos>'"),
    ({"eos_token_id": 40}, r"eos_token_id=40: expected null or a token id: an integer in \[0, 40\)"),
    ({"pad_token_id": -2}, r"pad_token_id=-2: expected null or a token id"),
    ({"bos_token_id": "1"}, r"bos_token_id='1': expected null or a token id"),
    ({"eos_token_id": True}, r"eos_token_id=True: expected"),
    ({"eos_token_id": [0, 99]}, r"eos_token_id=\[0, 99\]: expected .* or a non-empty list of them"),
    ({"eos_token_id": []}, r"eos_token_id=\[\]: expected"),
    ({"bos_token_id": [1]}, r"bos_token_id=\[1\]: expected null or a token id: an integer in \[0, 40\) "
                            r"\(model.vocab_size=40\)$"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings=0: expected an integer >= 1"),
    ({"max_position_embeddings": 512.0}, r"max_position_embeddings=512.0: expected an integer >= 1"),
])
def test_extra_config_that_config_json_would_not_carry_or_transformers_cannot_use_is_refused(extra, message,
                                                                                              tmp_path):
    """Before, an unknown key (a typo) was dropped without a word and any token id was written as given: an eos id
    past the vocabulary never stops generation, a string or negative one breaks it. Nothing is written."""
    m = dict(QWEN3_MOE)
    with pytest.raises(HFConversionError, match=message):
        export_hf_folder(m, source(m), tmp_path / "hf", extra_config=extra)
    assert folder_files(tmp_path) == []


def test_valid_extra_config_reaches_config_json_and_transformers(tmp_path):
    m = dict(QWEN3_MOE)
    export_hf_folder(m, source(m), tmp_path / "hf", dtype="fp32",
                     extra_config={"eos_token_id": [0, 39], "bos_token_id": 1, "pad_token_id": -1,
                                   "max_position_embeddings": 256})
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["bos_token_id"], cfg["pad_token_id"], cfg["max_position_embeddings"]) == \
        ([0, 39], 1, -1, 256)  # pad -1: "no padding token", as older Llama configs write it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert hf.generation_config.eos_token_id == [0, 39] and hf.config.max_position_embeddings == 256


@pytest.mark.parametrize(("value", "shown"), [("2GB", "'2GB'"), (0, "0"), (-1, "-1"), (1.5e9, "1500000000.0"),
                                              (True, "True")])
def test_a_max_shard_bytes_that_is_not_a_positive_byte_count_is_refused(value, shown, tmp_path):
    """Before, '2GB' (transformers' max_shard_size style) failed with a bare TypeError, and 0 or a negative count
    wrote one shard file per tensor."""
    m = dict(QWEN3_MOE)
    with pytest.raises(HFConversionError, match=rf"max_shard_bytes={shown}: expected a number of bytes, an integer"):
        export_hf_folder(m, source(m), tmp_path / "hf", max_shard_bytes=value)
    assert folder_files(tmp_path) == []


@pytest.mark.parametrize("field", ["num_experts", "vocab_size", "num_kv_heads", "init_std"])
def test_a_model_config_missing_a_field_is_refused_naming_it(field, tmp_path):
    """Before, a bare KeyError (e.g. a hand-written dict, or one of another tool)."""
    m = dict(QWEN3_MOE)
    state = source(m)
    del m[field]
    with pytest.raises(HFConversionError, match=rf"model_config has no '{field}': expected moe-train's model config"):
        export_hf_folder(m, state, tmp_path / "hf")
    assert folder_files(tmp_path) == []


@pytest.mark.parametrize("given", [".", "absolute"])
def test_an_export_into_the_current_directory_is_refused_and_leaves_it_as_it_was(given, tmp_path, monkeypatch):
    """Before, out_dir='.' failed with a bare OSError ('Device or resource busy', renaming '.' aside), and the same
    folder by its path was replaced by renaming: the process was left in a deleted folder (os.getcwd() raised
    FileNotFoundError, '.' listed nothing)."""
    m = dict(QWEN3_MOE)
    hf = tmp_path / "hf"
    export_hf_folder(m, source(m), hf, dtype="fp32")
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    monkeypatch.chdir(hf)
    with pytest.raises(HFConversionError, match=r"out_dir=.* is the current directory \(.*hf\): the export renames"):
        export_hf_folder(m, source(m), "." if given == "." else hf, dtype="bf16")
    assert os.getcwd() == str(hf) and {p.name: p.read_bytes() for p in hf.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or moved-aside folder left
    monkeypatch.chdir(tmp_path)
    export_hf_folder(m, source(m), "hf", dtype="bf16")  # named from its parent: replaced as usual
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
