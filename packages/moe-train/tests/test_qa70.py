"""QA 70: the Hugging Face export / import as a user drives it, on inputs the earlier HF tests did not use.

Defects (each test fails on the code it was written against; fixed in moe-train 0.16.1 / moe-ckpt 0.13.1):
- `export-hf RUN/checkpoints OUT`: the folder `inspect` takes (and export-hf's own argument check accepts) is
  refused by the reader with "no reader recognises it (expected ... a run dir with checkpoints/latest ...)".
- `--max-shard-bytes 500mb` / `5Gb`: transformers' max_shard_size (whose reading the CLI says it follows) takes a
  lowercase-b size as bits (1/8 of it); ours takes it as bytes and writes shards 8x the size transformers would.
- fp16 export of an ungated Qwen2-MoE shared expert whose down weight is in fp16's range but whose doubled export
  copy is not: refused as "a diverged checkpoint ... export an earlier checkpoint", which no earlier checkpoint fixes.

Guards: a re-export over a sharded export with another shard size leaves no shard of the earlier one, and transformers
loads it; a 1-byte shard size (one tensor per file) loads in transformers (fp16 and fp32) computing our model, and
import-hf of it is exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_ckpt.hf import HFConversionError, export_hf_folder
from moe_train.cli import main
from moe_train.hf_bridge import import_hf
from moe_train.trainer.loop import Trainer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import folder_tensors, our_logits, one_thread  # noqa: E402,F401
from test_qa61_hf_sweep import CASES, make_model  # noqa: E402


def test_export_hf_of_a_runs_checkpoints_folder_exports_its_latest_checkpoint(tmp_path, data_dir, make_config):
    """User runs `moe-train export-hf RUN/checkpoints OUT` (the folder `moe-train inspect RUN/checkpoints` reads,
    and which export-hf's own argument check, cli._existing_saved_run, accepts as a run's checkpoints folder).
    Sees: `error: checkpoint 'RUN/checkpoints': no reader recognises it (expected model.safetensors +
    config.json, a run dir with checkpoints/latest, ...)`: the folder holds `latest`, and nothing is written.
    Should see: the latest checkpoint exported (as `inspect` resolves it), or a refusal that says to pass the run
    folder or a step folder. (hf_bridge._resolve_checkpoint resolves only a run folder.)"""
    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1, threads=1)
    cfg.data.path = str(data_dir)
    cfg.model.shared_expert_hidden = 0  # Qwen3-MoE
    cfg.model.router.expert_bias = False
    Trainer(cfg).train()
    assert main(["inspect", str(tmp_path / "run" / "checkpoints")]) == 0  # inspect takes the folder
    assert main(["export-hf", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    from moe_train.trainer.init_from import check_init_source  # train.init_from reads the same folder alike

    cfg.train.init_from = str(tmp_path / "run" / "checkpoints")
    assert check_init_source(cfg) == tmp_path / "run" / "checkpoints" / "step-00000001"


def test_a_lowercase_b_shard_size_is_read_as_transformers_reads_it_or_refused():
    """User runs `export-hf RUN OUT --max-shard-bytes 500mb` (or 5Gb), the CLI help pointing at transformers'
    max_shard_size (cli._byte_size: "5GB as transformers' max_shard_size"). transformers reads a size ending in a
    lowercase b as bits (convert_file_size_to_int: "500mb" -> 62_500_000 bytes). Sees: shards of up to 500_000_000
    bytes, 8x what the same string gives in save_pretrained. Should see: the size transformers gives, or a refusal
    of the ambiguous unit (cli.py _byte_size upper-cases the unit, dropping the bits/bytes distinction)."""
    from transformers.utils.hub import convert_file_size_to_int

    from moe_train.cli import _byte_size

    for size in ("500mb", "5Gb", "64kb"):
        try:
            ours = _byte_size(size)
        except Exception:  # argparse.ArgumentTypeError: a refusal is fine
            continue
        assert ours == convert_file_size_to_int(size), (size, ours, convert_file_size_to_int(size))


def test_fp16_export_of_an_ungated_shared_expert_past_half_of_fp16s_range_names_the_doubling(tmp_path):
    """A Qwen2-MoE-shaped model with an ungated shared expert exports its shared down_proj doubled (the gate is
    pinned at sigmoid(0) = 0.5). A weight of 40000 is within fp16's range (65504), but its export copy (80000) is
    not. Sees: `tensor blocks.0.mlp.shared_expert.down.weight ... holds 1 NaN / Inf values ... (a diverged
    checkpoint, or values beyond torch.float16's range); export an earlier checkpoint`: no earlier checkpoint helps
    and the named weight is in range. Should see: a refusal saying the exported copy is 2x the weight (the pinned
    gate), past fp16's range, and that bf16 / fp32 export it (export.py _check_finite knows nothing of the x2)."""
    model = make_model(CASES["qwen2_moe_shared_ungated"][0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(k for k in state if k.endswith("shared_expert.down.weight"))
    state[name][0, 0] = 40000.0
    assert torch.isfinite(state[name].half()).all()  # the weight itself fits fp16
    with pytest.raises(HFConversionError) as err:
        export_hf_folder(dataclasses.asdict(model.cfg), state, tmp_path / "hf", dtype="fp16")
    message = str(err.value)
    assert "earlier checkpoint" not in message and ("doubl" in message or "2 x" in message or "x2" in message), message


def test_a_re_export_with_another_shard_size_leaves_no_earlier_shard_and_loads(tmp_path):
    """Guard: export with 1-byte shards (one tensor per file), then again into the same folder with 20KB shards:
    only the new shards are there, the index names exactly them, and transformers loads the folder."""
    model = make_model(CASES["glm4_moe_full"][0])
    m = dataclasses.asdict(model.cfg)
    out = tmp_path / "hf"
    first = export_hf_folder(m, model.state_dict(), out, dtype="fp16", max_shard_bytes=1)
    second = export_hf_folder(m, model.state_dict(), out, dtype="fp16", max_shard_bytes=20_000)
    assert first.shards > second.shards > 1
    files = {p.name for p in out.glob("*.safetensors")}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert files == set(index["weight_map"].values()) and len(files) == second.shards
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no .tmp / .old folder left beside it
    transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float16)


@pytest.mark.parametrize("case", ["qwen3_moe_dense_mixed_bias", "glm4_moe_topk_all_no_renorm_tied"])
def test_one_tensor_per_shard_fp16_export_computes_our_model_in_transformers_and_imports_exactly(case, tmp_path):
    """Guard: --max-shard-bytes smaller than any tensor gives one tensor per file (experts split over files);
    transformers fuses them on load and computes our model on fp16-rounded weights (fp32 and fp16 loads), and
    import-hf gives back the fp16-rounded weights bit-exactly (GLM's expert bias stays fp32)."""
    model = make_model(CASES[case][0])
    state = model.state_dict()
    summary = export_hf_folder(dataclasses.asdict(model.cfg), state, tmp_path / "hf", dtype="fp16", max_shard_bytes=1)
    stored = folder_tensors(tmp_path / "hf")
    assert summary.num_tensors == len(stored)
    assert summary.shards == sum(1 for t in stored.values() if t.numel())  # GLM's empty shared expert rides along
    rounded = {k: (v if k.endswith("expert_bias") else v.half().float()) for k, v in state.items()}
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(70))
    ours = our_logits(model.cfg, rounded, ids)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=dtype).eval()
        with torch.no_grad():
            gap = (hf(ids).logits.float() - ours).abs().max().item()
        assert gap <= tol, (dtype, gap)
    _, back = import_hf(tmp_path / "hf", tmp_path / "ours")
    assert back.keys() == rounded.keys()
    for k in rounded:
        assert torch.equal(back[k], rounded[k]), k
