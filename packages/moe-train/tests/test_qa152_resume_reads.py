"""QA 152 (review helper 171): a resume reads a single-process fp32 weight as its own master (saved once), and chose
that by index.json's recorded dtype before any shard header was read. An index.json whose dtype for a weight was
edited to bfloat16 was then resumed as if the master were missing: "tensors ['optim.X.master'] are not in the
checkpoint", naming a tensor the checkpoint never had, where export-hf of the same checkpoint names the disagreement
("stored as F32 ...; index.json says BF16"). Now the weight is read, the shard's header is checked against
index.json, and a master read from a weight that really is not float32 is refused naming both."""

from __future__ import annotations

import json

import pytest
import torch

from moe_ckpt import CheckpointError, DtypeMismatchError, ShardSpec, save_checkpoint
from moe_train.trainer import checkpoint
from moe_train.trainer.runtime import CheckpointShard


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_index_json_whose_weight_dtype_was_edited_is_refused_naming_the_disagreement(tmp_path, data_dir,
                                                                                     make_config):
    from moe_train.trainer.loop import Trainer

    cfg = make_config(tmp_path, steps=1, save_interval=1, eval_interval=0, log_interval=1, grad_accum=1,
                      warmup_steps=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    step = tmp_path / "run" / "checkpoints" / "step-00000001"
    index = json.loads((step / "index.json").read_text())
    name = next(n for n, t in index["tensors"].items() if not n.startswith("optim.") and t["dtype"] == "float32"
                and len(t["shape"]) == 2)
    index["tensors"][name]["dtype"] = "bfloat16"
    (step / "index.json").write_text(json.dumps(index, indent=1))
    cfg.train.steps = 2
    with pytest.raises(CheckpointError) as caught:
        Trainer(cfg).train()
    message = str(caught.value)
    assert "not in the checkpoint" not in message, message
    assert name in message and "F32" in message and "BF16" in message, message


def test_a_master_read_from_a_weight_that_is_not_float32_is_refused_naming_both(tmp_path):
    weight = torch.arange(6, dtype=torch.float32).view(2, 3).to(torch.bfloat16)
    path = tmp_path / "step-00000001"
    save_checkpoint(path, [ShardSpec("w", (2, 3), weight)], {"step": 1})
    shard = CheckpointShard("optim.w.master", (2, 3), ((0, 2), (0, 3)), torch.zeros(2, 3), is_writer=True)
    with pytest.raises(DtypeMismatchError, match=r"optim.w.master is not saved, and its weight w is torch.bfloat16: "
                                                 r"a master is saved once as its weight only when that weight is "
                                                 r"float32 .* lacks the fp32 master"):
        checkpoint._read(path, [shard], torch.device("cpu"))
    fp32 = tmp_path / "step-00000002"
    save_checkpoint(fp32, [ShardSpec("w", (2, 3), weight.float())], {"step": 2})
    assert torch.equal(checkpoint._read(fp32, [shard], torch.device("cpu"))["optim.w.master"], weight.float())
