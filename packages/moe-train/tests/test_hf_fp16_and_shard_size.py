"""fp16 exports (for GPUs without bf16) and `export-hf --max-shard-bytes`: transformers loads the fp16 folder and
computes what our model computes with its weights rounded to fp16; a weight past fp16's range is refused naming
the tensor; HF fp16 -> ours -> HF fp16 is bit-identical; the CLI caps shard sizes and refuses a size it cannot read."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from moe_ckpt.hf import HFConversionError, export_hf_folder
from moe_train.cli import main
from moe_train.hf_bridge import export_hf, import_hf

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import folder_tensors, hf_logits, our_logits, one_thread  # noqa: E402,F401
from test_hf_export import VARIANTS, make_model  # noqa: E402


@pytest.mark.parametrize("variant", ["qwen3_moe", "glm4_moe_shared_bias", "qwen2_moe_shared"])
def test_an_fp16_export_loads_in_fp16_and_computes_our_model_on_fp16_weights(variant, tmp_path):
    model = make_model(**VARIANTS[variant])
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp16")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "float16"
    stored = folder_tensors(tmp_path / "hf")
    assert {t.dtype for name, t in stored.items() if not name.endswith(".e_score_correction_bias")} == {torch.float16}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype="auto")
    assert hf.get_input_embeddings().weight.dtype == torch.float16
    rounded = {k: (v if k.endswith("expert_bias") else v.half().float()) for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    gap = (hf_logits(tmp_path / "hf", ids) - our_logits(model.cfg, rounded, ids)).abs().max().item()
    assert gap <= 1e-4, gap


def test_a_weight_past_fp16s_range_is_refused_naming_it(tmp_path):
    model = make_model(**VARIANTS["qwen3_moe"])
    state = dict(model.state_dict())
    name = next(k for k in state if k.endswith("mlp.experts.w_down"))
    w = state[name].clone()
    w[1, 2, 3] = 7.0e4  # fp16's largest finite value is 65504: it would load as inf
    state[name] = w
    with pytest.raises(HFConversionError, match=rf"tensor {name} \(exported as .*torch.float16\) holds 1 NaN / Inf "
                                                r"values .*beyond torch.float16's range"):
        export_hf_folder(dataclasses.asdict(model.cfg), state, tmp_path / "hf", dtype="fp16")
    assert not (tmp_path / "hf").exists()
    export_hf_folder(dataclasses.asdict(model.cfg), state, tmp_path / "hf", dtype="bf16")  # bf16 holds it


@pytest.mark.filterwarnings("ignore:export of .*no tokenizer found")
def test_hf_fp16_to_ours_to_hf_fp16_is_bit_identical(tmp_path):
    model = make_model(**VARIANTS["glm4_moe_shared_bias"])
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp16")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "again", dtype="fp16")
    first, again = folder_tensors(tmp_path / "hf"), folder_tensors(tmp_path / "again")
    assert first.keys() == again.keys()
    for name in first:
        assert first[name].dtype == again[name].dtype and torch.equal(first[name], again[name]), name
    assert (json.loads((tmp_path / "hf" / "config.json").read_text())
            == json.loads((tmp_path / "again" / "config.json").read_text()))


def test_export_hf_max_shard_bytes_caps_each_shard(tmp_path, capsys):
    model = make_model(**VARIANTS["qwen3_moe"])
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    assert main(["export-hf", str(tmp_path / "ours"), str(tmp_path / "sharded"), "--dtype", "fp16",
                 "--max-shard-bytes", "20KB"]) == 0
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    for shard in shards:
        tensors = load_file(shard)
        data = sum(t.numel() * t.element_size() for t in tensors.values())
        assert data <= 20_000 or len(tensors) == 1, (shard.name, data)  # one tensor larger than the cap: alone
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in folder_tensors(tmp_path / "sharded").values())
    assert "of fp16 in" in capsys.readouterr().out


@pytest.mark.parametrize("size", ["0", "1.5GB", "5XB", "GB", "-3", "", "²GB"])
def test_export_hf_refuses_a_shard_size_it_cannot_read(size, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--max-shard-bytes", size])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--max-shard-bytes" in err and f"{size!r}: expected a size >= 1 byte" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size,expected", [("1000", 1000), ("5GB", 5 * 10**9), ("2gib", 2 * 2**30), ("64KiB", 65536),
                                           ("500MB", 5 * 10**8), ("7B", 7)])
def test_shard_sizes_read_as_transformers_writes_them(size, expected):
    from moe_train.cli import _byte_size

    assert _byte_size(size) == expected
