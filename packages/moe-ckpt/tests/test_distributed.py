import json

import pytest
import torch.multiprocessing as mp
from moe_ckpt_dist_worker import save_then_reshard

from moe_ckpt import inspect_checkpoint


@pytest.mark.slow
def test_gloo_world2_save_reloads_bit_identically_as_4_ranks_1_rank_and_whole(tmp_path):
    mp.spawn(save_then_reshard, args=(2, str(tmp_path)), nprocs=2, join=True)
    info = inspect_checkpoint(tmp_path / "run" / "step-00000001")
    assert info["world_size"] == 2 and info["metadata"]["layout"] == {"dp": 2, "ep": 2, "zero": "flat"}
    assert sorted(info["files"]) == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    idx = json.loads((tmp_path / "run" / "step-00000001" / "index.json").read_text())
    assert [p["flat"] for p in idx["tensors"]["opt.exp_avg.attn.w"]["pieces"]] == [[0, 18], [18, 17]]
