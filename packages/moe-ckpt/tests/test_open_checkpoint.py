"""open_checkpoint: many reads from one checkpoint with index.json parsed once and each shard file opened once,
giving exactly what load_checkpoint gives and refusing exactly what it refuses."""

from __future__ import annotations

import pytest
from ckpt_cases import SPECS, bits_equal, edit_header, make_state, requests_for, reseal, run_ranks, shards_for

import moe_ckpt.load
from moe_ckpt import (
    ChecksumMismatchError,
    CorruptShardError,
    LoadRequest,
    NonFiniteTensorError,
    load_checkpoint,
    open_checkpoint,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)

WORLD = 4


@pytest.fixture
def ck4(tmp_path):
    """Experts split along dim 0, optimizer state and a bias in flat ranges, replicated params: 4 rank files."""
    state = make_state(7)
    path = step_dir(tmp_path / "run", 5)
    run_ranks(WORLD, lambda r, bar: save_checkpoint(path, shards_for(state, r, WORLD), {"step": 5}, r, WORLD, bar))
    return path


def _count_calls(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)

    def counted(*args, **kw):
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_open_checkpoint_reads_every_tensor_bit_identical_to_load_checkpoint(ck4, monkeypatch):
    """Every tensor whole, then every rank's dim-0 and flat slices under other layouts, one request at a time;
    index.json is parsed once and each of the 4 shard files opened once for all of them."""
    requests = [LoadRequest(name) for name in SPECS]
    requests += [r for world, style in [(3, "dim0"), (5, "flat")] for rank in range(world)
                 for r in requests_for(rank, world, style)]
    want = [load_checkpoint(ck4.parent, [r])[r.name] for r in requests]  # via the run dir's latest
    parses = _count_calls(monkeypatch, moe_ckpt.load, "read_index")
    opens = _count_calls(monkeypatch, moe_ckpt.load, "safe_open")
    with open_checkpoint(ck4.parent) as ckpt:
        assert ckpt.path == ck4 and ckpt.names == sorted(SPECS) and len(parses) == 1
        got = [ckpt.read([r])[r.name] for r in requests]
        assert bits_equal(ckpt.read()["experts.w1"], want[0])  # requests=None: every tensor whole
    assert len(parses) == 1 and sorted(str(a[0].name) for a in opens) == [
        f"shard-{r:05d}-of-{WORLD:05d}.safetensors" for r in range(WORLD)]
    assert len(got) == len(want) > 30
    for r, a, b in zip(requests, got, want):
        assert bits_equal(a, b), f"{r.name} {r.region}"


def test_a_damaged_shard_is_refused_through_open_checkpoint_on_every_read(ck4):
    """A flipped byte fails each read that touches the file (an error is not cached as a checked file), and
    check_all_files fails before any read; files the reads do not touch still read."""
    shard1 = ck4 / "shard-00001-of-00004.safetensors"
    raw = bytearray(shard1.read_bytes())
    raw[-3] ^= 0xFF
    shard1.write_bytes(raw)
    with open_checkpoint(ck4) as ckpt:
        assert ckpt.read([LoadRequest("attn.w")])["attn.w"].shape == (7, 5)  # rank 0 wrote it whole
        for _ in range(2):
            with pytest.raises(ChecksumMismatchError, match=rf"{shard1} has crc32 .*index.json says .*: corrupt"):
                ckpt.read([LoadRequest("experts.w1")])
        with pytest.raises(ChecksumMismatchError, match="shard-00001-of-00004"):
            ckpt.check_all_files()
    with pytest.raises(ChecksumMismatchError, match="shard-00001-of-00004"):
        verify_checkpoint(ck4)


def test_a_shard_header_that_disagrees_with_the_index_is_refused_through_open_checkpoint(ck4):
    shard0 = ck4 / "shard-00000-of-00004.safetensors"
    edit_header(shard0, "attn.w[0:7,0:5]", dtype="I32")
    reseal(ck4)  # sizes and checksums agree again: only the header check can see it
    with open_checkpoint(ck4, verify=False) as ckpt:
        for _ in range(2):
            with pytest.raises(CorruptShardError, match=r"'attn.w\[0:7,0:5\]' is stored as I32 \[7, 5\]"):
                ckpt.read([LoadRequest("experts.w1")])  # its rank-0 piece lives in the same file


def test_require_finite_through_open_checkpoint_and_reads_after_close_are_refused(ck4):
    """make_state puts a NaN in every float tensor of more than two values."""
    with open_checkpoint(ck4) as ckpt:
        with pytest.raises(NonFiniteTensorError, match=r"'experts.w1' in .*step-00000005: \[0:2,0:6,0:5\] holds 1 NaN"):
            ckpt.read([LoadRequest("experts.w1")], require_finite=True)
        assert ckpt.read([LoadRequest("step")], require_finite=True)["step"].shape == ()
    with pytest.raises(ValueError, match=r"step-00000005 was closed; read it inside its `with open_checkpoint"):
        ckpt.read([LoadRequest("step")])
