"""inspect_checkpoint / format_checkpoint (what `python -m moe_ckpt DIR` and `moe-train inspect` print) say when a
shard file index.json records is missing or of another size: they listed every tensor as if the data were there
(review of moe-ckpt 0.21.1), while loading refused the checkpoint. Sizes only: a checksum reads every byte."""

from __future__ import annotations


from moe_ckpt import format_checkpoint, inspect_checkpoint, reports_damage

SHARD0, SHARD1 = "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"


def test_a_whole_checkpoint_has_no_problems(ck2):
    assert inspect_checkpoint(ck2)["file_problems"] == []
    assert "DAMAGED" not in format_checkpoint(ck2)
    assert not reports_damage(format_checkpoint(ck2))


def test_a_missing_and_a_truncated_shard_are_named(ck2):
    size = (ck2 / SHARD1).stat().st_size
    (ck2 / SHARD0).unlink()
    with open(ck2 / SHARD1, "r+b") as f:
        f.truncate(size - 5)
    want = [f"{SHARD0} (rank 0) is missing", f"{SHARD1} (rank 1) has {size - 5:,} bytes, index.json records {size:,}"]
    assert inspect_checkpoint(ck2)["file_problems"] == want
    lines = format_checkpoint(ck2).splitlines()
    # the first line (0.21.7 put it after the header lines, where `| head -3` hid it; review helper 155)
    assert lines[0] == f"DAMAGED: {'; '.join(want)} (this checkpoint cannot be loaded)", lines[:5]
    assert reports_damage(format_checkpoint(ck2))  # the one test both commands make for their exit status


def test_python_m_moe_ckpt_exits_1_on_a_damaged_checkpoint_and_0_on_a_whole_one(ck2, capsys):
    from moe_ckpt.__main__ import main

    assert main([str(ck2)]) == 0
    capsys.readouterr()
    (ck2 / SHARD0).unlink()
    assert main([str(ck2)]) == 1
    assert capsys.readouterr().out.startswith(f"DAMAGED: {SHARD0} (rank 0) is missing")
