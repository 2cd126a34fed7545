"""A trained run folder exports through the CLI and stock transformers reproduces the run's model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_train.cli import main
from moe_train.trainer.loop import Trainer
from metadata_edit import rewrite_metadata  # noqa: E402

transformers = pytest.importorskip("transformers")


def test_export_hf_of_a_trained_run_matches_its_model(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)
    cfg.data.path = str(data_dir)
    cfg.model.shared_expert_hidden = 0  # softmax + per-head QK-norm, no shared expert: Qwen3-MoE
    cfg.model.router.expert_bias = False
    trainer = Trainer(cfg)
    trainer.train()
    out = tmp_path / "hf"
    assert main(["export-hf", str(tmp_path / "run"), str(out), "--dtype", "fp32"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 24))
    trainer.model.eval()
    with torch.no_grad():
        ours, _ = trainer.model(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert (out / "tokenizer.json").is_file()  # the data folder's tokenizer travels with the export


def test_export_without_a_findable_tokenizer_warns(tmp_path, data_dir, make_config):
    """The tokenizer is found through the run's data.path; when that folder is not there (moved,
    or a relative path taken from another directory) the export says it has no tokenizer."""
    import json

    from moe_ckpt import find_latest
    from moe_train.hf_bridge import export_hf

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    cfg.model.shared_expert_hidden = 0
    cfg.model.router.expert_bias = False
    Trainer(cfg).train()
    meta_file = find_latest(tmp_path / "run" / "checkpoints") / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["data"]["path"] = str(tmp_path / "moved-away")
    rewrite_metadata(meta_file, meta)
    with pytest.warns(UserWarning, match="no tokenizer found for data.path=.*moved-away"):
        export_hf(tmp_path / "run", tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()


def test_export_of_a_sharded_checkpoint_parses_its_index_once_and_closes_its_files(tmp_path, make_config,
                                                                                     monkeypatch):
    """Before: one load_checkpoint per tensor, each re-reading and re-checking index.json (minutes for a model
    of thousands of tensors). Now one open_checkpoint for the export, closed when it ends, also when it fails;
    the weights are the fp32 masters where the optimizer kept them, split over two ranks' files."""
    import threading

    import moe_ckpt.load
    from moe_ckpt import Box, ShardSpec, save_checkpoint
    from moe_ckpt.hf import HFConversionError
    from moe_train import hf_bridge
    from moe_train.model import Transformer

    cfg = make_config(tmp_path)
    cfg.model.shared_expert_hidden = 0
    cfg.model.router.expert_bias = False
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    state = {k: v.detach() for k, v in model.state_dict().items()}

    def shards(rank: int) -> list[ShardSpec]:
        out = []
        for name, t in state.items():
            if t.dim() and t.shape[0] % 2 == 0:  # a master split along dim 0, and a weight that is not it
                rows = t.shape[0] // 2
                out.append(ShardSpec(f"optim.{name}.master", tuple(t.shape), t[rank * rows:(rank + 1) * rows],
                                     Box.dim0(tuple(t.shape), rank * rows, rows)))
                out.append(ShardSpec(name, tuple(t.shape), torch.zeros_like(t), writer=rank == 0))
            else:
                out.append(ShardSpec(name, tuple(t.shape), t, writer=rank == 1))
        return out

    bar = threading.Barrier(2)
    threads = [threading.Thread(target=save_checkpoint, args=(tmp_path / "ck", shards(r), {"config": cfg.to_dict()},
                                                              r, 2, bar.wait)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    parses, opened = [], []
    real_read_index, real_open = moe_ckpt.load.read_index, hf_bridge.open_checkpoint
    monkeypatch.setattr(moe_ckpt.load, "read_index", lambda p: parses.append(p) or real_read_index(p))
    monkeypatch.setattr(hf_bridge, "open_checkpoint", lambda p: opened.append(real_open(p)) or opened[-1])
    with pytest.warns(UserWarning, match="no tokenizer found"):
        hf_bridge.export_hf(tmp_path / "ck", tmp_path / "hf", dtype="fp32")
    assert len(state) == 25 and len(parses) <= 2  # load_metadata's and open_checkpoint's
    with pytest.raises(ValueError, match="was closed"):
        opened[0].read()
    hf_bridge.export_hf(model, tmp_path / "hf-model", dtype="fp32")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "hf-model" /
                                                                    "model.safetensors").read_bytes()

    with pytest.raises(HFConversionError, match="tokenizer_json=.*none.json' is not a file"):
        hf_bridge.export_hf(tmp_path / "ck", tmp_path / "hf2", dtype="fp32", tokenizer_json=tmp_path / "none.json")
    assert len(opened) == 2
    with pytest.raises(ValueError, match="was closed"):
        opened[-1].read()
