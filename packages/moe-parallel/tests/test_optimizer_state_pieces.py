"""DistributedAdamW.state_pieces(): the sharded masters and moments in global coordinates (one spawn of 4 gloo ranks).

fp64, a small MoE whose experts are sliced over ep=2, FlatParams buckets of 100 elements (shards cut through
parameters), 2 steps at dp=4 ep=2, then (state_pieces_worker.py):
(a) the owner pieces of all ranks tile every element of every parameter's global master / exp_avg / exp_avg_sq
    (all E experts) exactly once; the assembled masters are the gathered model weights, bit for bit, and within
    1e-9 of torch.optim.AdamW on one process over the global batch;
(b) the assembled state written into the pieces of a new optimizer at world 2 (dp=2 ep=1 sharded; dp=2 ep=2
    unsharded, whose replicas are not owners), with the step counts and refresh_weights(), takes a 3rd step equal
    to the unbroken 4-rank run's 3rd step: grad norm, weights and every state tensor within 1e-12;
(c) a piece's tensor is a view: masters written through the pieces come back as the model weights after
    refresh_weights(), and moments written through them are the optimizer's own.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
w = importlib.import_module("state_pieces_worker")
parallel_spawn = importlib.import_module("parallel_spawn")

pytestmark = pytest.mark.slow

DEADLINE_S = 60  # the spawn takes ~3 s
KEYS = ("master", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return parallel_spawn.run_ranks(w.run_rank, w.WORLD, tmp_path_factory.mktemp("state_pieces"), DEADLINE_S)


@pytest.fixture(scope="module")
def ref() -> list[dict[str, torch.Tensor]]:
    return w.reference(w.SAVED_AT + 1)


def gathered(per_rank: list[dict[str, tuple[torch.Tensor, int]]], shapes: dict[str, torch.Size]) -> dict:
    """name -> global tensor from each rank's (local tensor, first row): experts from their ep ranks' slices."""
    out = {n: torch.full(shape, float("nan"), dtype=torch.float64) for n, shape in shapes.items()}
    for weights in per_rank:
        for n, (t, row) in weights.items():
            out[n][row : row + t.shape[0]] = t if t.dim() else t.reshape(())
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_workers_import_the_code_under_test(ranks):
    import moe_parallel

    assert {r["moe_parallel_file"] for r in ranks} == {moe_parallel.__file__}


@pytest.mark.parametrize("run", ["source", "dp2_ep2_unsharded"])
def test_owner_pieces_tile_every_element_of_every_global_state_exactly_once(ranks, ref, run):
    per_rank = [r["pieces"] for r in ranks] if run == "source" else [r[run]["pieces"] for r in ranks[:2]]
    pieces = [p for rank_pieces in per_rank for p in rank_pieces]
    shapes = {n: t.shape for n, t in ref[0].items()}
    for p in pieces:
        assert p.key in KEYS and p.global_shape == tuple(shapes[p.name]), (p.name, p.key, p.global_shape)
        assert p.tensor.dtype == torch.float64 and p.tensor.dim() == 1 and p.numel > 0, (p.name, p.key)
    for name, shape in shapes.items():
        for key in KEYS:
            hits = torch.zeros(math.prod(shape), dtype=torch.int64)
            for p in pieces:
                if p.owner and (p.name, p.key) == (name, key):
                    hits[p.offset : p.offset + p.numel] += 1
            assert hits.eq(1).all(), f"{run}: {name}.{key} elements owned {hits.tolist()} times"
    if run == "source":  # every piece sharded: owners only; and shards cut through parameters
        assert all(p.owner for p in pieces)
        assert any(p.numel < math.prod(shapes[p.name]) and p.offset > 0 for p in pieces)
    else:  # dense state replicated on both ranks: the second is no owner, yet was loaded (checked below)
        assert any(not p.owner for p in pieces) and any(p.owner for p in per_rank[1])


def test_assembled_masters_are_the_gathered_weights_and_one_process_adamw(ranks, ref):
    saved = w.assemble(p for r in ranks for p in r["pieces"])
    shapes = {n: t.shape for n, t in ref[0].items()}
    masters = {n: saved[n, "master"] for n in shapes}
    model = gathered([r["weights"] for r in ranks], shapes)
    for n in shapes:
        assert torch.equal(masters[n], model[n]), n  # fp64 weights are their masters
    diff = max_diff(masters, ref[w.SAVED_AT - 1])
    assert diff < 1e-9, f"masters {diff:.3g} off torch AdamW on one process after {w.SAVED_AT} steps"
    assert all(not t.isnan().any() for t in saved.values())
    want = {n: w.SAVED_AT - (n.startswith("late.")) for n in shapes}  # late.* got no gradient in step 0
    assert all(r["counts"] == want and r["taken"] == w.SAVED_AT for r in ranks)


@pytest.mark.parametrize("run", list(w.RESTORES))
def test_a_step_after_restoring_on_another_layout_equals_the_unbroken_step(ranks, ref, run):
    shapes = {n: t.shape for n, t in ref[0].items()}
    saved = w.assemble(p for r in ranks for p in r["pieces"])
    restored = [r[run] for r in ranks[:2]]
    loaded = gathered([r["loaded_weights"] for r in restored], shapes)
    assert max_diff(loaded, {n: saved[n, "master"] for n in shapes}) == 0.0  # refresh_weights(): the masters
    for rank, got in enumerate(restored):
        assert got["counts"] == ranks[0]["counts"], rank
        for p in got["loaded_pieces"]:  # owner or not, every piece was written
            want = saved[p.name, p.key].reshape(-1)[p.offset : p.offset + p.numel]
            assert torch.equal(p.tensor, want), (rank, p.name, p.key, p.owner)
        straight_norm = ranks[0]["straight_norm"]
        assert abs(got["norm"] - straight_norm) <= 1e-12 * straight_norm, (got["norm"], straight_norm)
    straight = gathered([r["straight_weights"] for r in ranks], shapes)
    resumed = gathered([r["weights"] for r in restored], shapes)
    diff = max_diff(resumed, straight)
    assert diff < 1e-12, f"{run}: weights {diff:.3g} off the unbroken run's step {w.SAVED_AT + 1}"
    state = max_diff(w.assemble(p for r in restored for p in r["pieces"]),
                     w.assemble(p for r in ranks for p in r["straight_pieces"]))
    assert state < 1e-12, f"{run}: optimizer state {state:.3g} off the unbroken run's"
    assert max_diff(straight, ref[w.SAVED_AT]) < 1e-9


def test_a_piece_is_a_view_writing_into_it_writes_the_optimizer_state(ranks, ref):
    for rank, r in enumerate(ranks):
        got = r["written"]
        for n, (t, row) in got["weights"].items():  # masters set to their global flat index, then refresh_weights()
            row_numel = math.prod(ref[0][n].shape[1:])
            want = torch.arange(row * row_numel, row * row_numel + t.numel(), dtype=t.dtype).view(t.shape)
            assert torch.equal(t, want), (rank, n)
        assert got["exp_avg_sum"] == 7.0 * got["exp_avg_pieces"] > 0, rank  # the moments hold what was written
