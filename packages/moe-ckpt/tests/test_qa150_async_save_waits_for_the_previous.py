"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

AsyncCheckpointer.save must wait for the save in flight before it snapshots: the snapshot buffers are reused, so a
second save that did not wait would overwrite the first save's buffer while the first is still writing it (step N's
checkpoint holding step N+1's weights), and two saves would run at once. Removing that wait passed every test: the
tested saves always finished before the next began. Here the first write is held until the second save was asked."""

import threading

import torch

import moe_ckpt.async_save as async_save
from moe_ckpt import AsyncCheckpointer, ShardSpec


def test_a_second_save_waits_and_leaves_the_first_snapshot_alone(monkeypatch, tmp_path):
    release = threading.Event()
    written = {}

    def fake_save_checkpoint(path, shards, meta, rank, world_size, barrier, **kw):
        if not written:
            release.wait(timeout=10)  # the first save is still writing
        written[str(path)] = shards[0].tensor.clone()

    monkeypatch.setattr(async_save, "save_checkpoint", fake_save_checkpoint)
    w = torch.ones(4)
    ckpt = AsyncCheckpointer()
    ckpt.save(tmp_path / "a", [ShardSpec("w", (4,), w)])
    w.fill_(2.0)  # the next step's weights
    second = threading.Thread(target=ckpt.save, args=(tmp_path / "b", [ShardSpec("w", (4,), w)]))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive(), "the second save returned while the first was still writing"
    release.set()
    second.join(timeout=10)
    ckpt.wait()
    assert torch.equal(written[str(tmp_path / "a")], torch.ones(4))
    assert torch.equal(written[str(tmp_path / "b")], torch.full((4,), 2.0))
