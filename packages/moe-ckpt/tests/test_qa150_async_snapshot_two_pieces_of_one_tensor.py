"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

A rank may hold (and save) two regions of one tensor (e.g. two non-adjacent blocks of expert rows). The async
snapshot keys its reused CPU buffers by name and region; keyed by name alone, two same-shaped pieces shared one
buffer and both were written with the second's data. No test saved two pieces of one name from one rank."""

import torch

from moe_ckpt import AsyncCheckpointer, Box, ShardSpec, load_checkpoint


def test_two_pieces_of_one_tensor_from_one_rank_keep_their_own_data(tmp_path):
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    shards = [ShardSpec("w", (4, 3), full[0:2].clone(), Box.dim0((4, 3), 0, 2)),
              ShardSpec("w", (4, 3), full[2:4].clone(), Box.dim0((4, 3), 2, 2))]
    with AsyncCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step-1", shards)
    assert torch.equal(load_checkpoint(tmp_path / "step-1")["w"], full)
