"""train.loss_chunk_tokens on two gloo ranks: the chunked head and loss train the same steps as the whole logits
under the FSDP2 baseline and under DDP with expert parallelism and tied embeddings, with and without the LM head's
z-loss (chunked_loss_worker.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import chunked_loss_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("chunked2")
    h.start_ranks(h.run_guarded, args=(w.worker2, str(out_dir), h.free_port(), h.token_stream()), nprocs=2)
    return h.load_results(out_dir, 2)


@pytest.mark.parametrize("z", ["", "_z"])
@pytest.mark.parametrize("name", ["fsdp", "ep"])
def test_chunked_loss_trains_the_same_steps(two_ranks, name, z):
    got_key, want_key = f"{name}_{w.CHUNK}{z}", f"{name}_0{z}"
    for rank, res in enumerate(two_ranks):
        got, want = res[got_key], res[want_key]
        assert (got["chunk"], want["chunk"]) == (w.CHUNK, 0)
        assert got["z_weight"] == want["z_weight"] == (w.Z_WEIGHT if z else 0.0)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-4, atol=1e-6)
    got = h.assemble([res[got_key]["weights"] for res in two_ranks])
    want = h.assemble([res[want_key]["weights"] for res in two_ranks])
    assert set(got) == set(want)
    for param, v in want.items():
        torch.testing.assert_close(got[param], v, rtol=1e-4, atol=1e-6, msg=param)


@pytest.mark.parametrize("name", ["fsdp", "ep"])
def test_the_z_loss_changes_the_training(two_ranks, name):
    """The runs above with and without the z-loss are not the same run: its gradient reaches the weights."""
    with_z = h.assemble([res[f"{name}_0_z"]["weights"] for res in two_ranks])
    without = h.assemble([res[f"{name}_0"]["weights"] for res in two_ranks])
    moved = [n for n in without if not torch.allclose(with_z[n], without[n], rtol=1e-3, atol=1e-5)]
    assert moved, "the z-loss changed no weight"
