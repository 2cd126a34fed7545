"""QA 146: review helper 150 of moe-parallel 0.12.2 as a standalone user, on gloo ranks.

Found (each fixed in moe-parallel 0.12.4; every test here fails on 0.12.3):
1. A checkpointed MoE layer and a parameter used on some ranks only: the router's load-balance all-reduce (on
   groups.dp, set by apply_expert_parallel) is re-run during backward, while rank 0 had launched the unused
   parameter's bucket (and those after it) from the hooks and rank 1 held them for finish(): on one group the
   collectives paired up out of order and gloo aborted the process ("Received data size doesn't match"). The
   forward's collectives now have a group of their own, `groups.dp_forward` (the dp ranks).
2. With grads bound to the flat buffer (grad_dtype = the weights' dtype), a .grad replaced out of place between
   micro-batches (p.grad = p.grad * s) or by backward(create_graph=True) was added on top of the buffer that still
   held the earlier micro-batches: counted twice (create_graph: 2^(M-1-m) g_m), a mask ignored.
3. build_groups(timeout=...) did not reach groups.world (the default group), which DistributedAdamW's global norm
   uses every step: a late rank left the others waiting init_process_group's timeout (30 minutes by default).
4. A non-finite step(lr), or an AdamWConfig field assigned an invalid value after construction (never checked: the
   weights turned NaN), raised on that rank only (the others waited in the norm's all-reduce): now refused on every
   rank through that all-reduce, nothing updated.
"""

from __future__ import annotations

import functools
import importlib
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("qa146_worker")
parallel_spawn = importlib.import_module("parallel_spawn")

DEADLINE_S = 120


def _run(case: str, tmp_path) -> list[dict]:
    results = parallel_spawn.run_ranks(functools.partial(worker.run_rank, case=case), 2, tmp_path, DEADLINE_S)
    return [r[case] for r in results]


def test_a_checkpointed_moe_layer_beside_a_parameter_unused_on_one_rank_trains(tmp_path):
    got = _run("checkpointed_branch_on_rank0", tmp_path)
    for r in got:
        assert not r[True]["lb_group_is_dp"]
        # overlapped (buckets launched from the hooks) and not: the same reductions, bit for bit
        assert r[True]["norms"] == r[False]["norms"] and torch.equal(r[True]["weights"], r[False]["weights"])
    assert got[0][True]["norms"] == got[1][True]["norms"]
    assert torch.equal(got[0][True]["weights"], got[1][True]["weights"])


def test_a_replaced_grad_is_the_gradient_so_far_not_added_to_it(tmp_path):
    got = _run("replaced_grads", tmp_path)
    for r in got:
        for case in ("scaled", "create_graph", "scaled_then_unused"):
            for name, want in r["want"][case].items():
                gap = (r[case][name] - want).abs().max().item()
                assert torch.allclose(r[case][name], want, rtol=1e-5, atol=1e-6), (case, name, gap)


def test_create_graph_with_a_separate_fp32_gradient_buffer_keeps_the_buffer_out_of_the_graph(tmp_path):
    for r in _run("unbound_create_graph", tmp_path):
        assert not r["buffer_in_graph"] and r["finite"] and r["nonzero"], r


def test_a_bad_lr_or_config_on_one_rank_is_refused_on_every_rank_and_nothing_moves(tmp_path):
    rank0, rank1 = _run("refused_step", tmp_path)
    assert "lr=nan must be a finite number" in rank1["lr"]
    assert "betas=(1.0, 0.95)" in rank1["config"]
    for case in ("lr", "config"):
        assert "another rank refused" in rank0[case] and "no rank updated" in rank0[case], rank0[case]
    for r in (rank0, rank1):
        assert r["unchanged"] and r["then"] is False and r["moved"]


def test_build_groups_timeout_reaches_the_optimizers_world_group(tmp_path):
    got = _run("late_rank_at_the_step", tmp_path)
    rank0 = got[0]
    assert not rank0["world_is_default"]
    assert rank0["outcome"].startswith("RuntimeError"), rank0
    assert rank0["waited_s"] < 5.0, rank0  # 2 s timeout; rank 1 arrived 6 s late



def test_build_groups_timeout_bounds_its_own_agreement_check(tmp_path):
    rank0 = _run("late_rank_at_build_groups", tmp_path)[0]
    assert rank0["outcome"].startswith("RuntimeError"), rank0
    # moe-parallel 0.13.5: which group and why, not the store's bare "wait timeout after 2000ms, keys: ..."
    assert "build_groups: rank 0 of 2 could not create the world group" in rank0["outcome"], rank0
    assert "the ranks did not all reach it in time; one of them is late or stopped" in rank0["outcome"], rank0
    assert rank0["waited_s"] < 5.0, rank0  # 2 s timeout; rank 1 arrived 6 s late


def test_build_groups_passes_an_error_other_than_a_rendezvous_timeout_through_as_it_is(tmp_path, monkeypatch):
    """moe-parallel 0.13.5 called every RuntimeError of new_group a late or stopped rank (review helper 162): a
    backend that cannot start here (no such network interface) or out of memory has nothing to do with the others."""
    import torch.distributed as dist

    from moe_parallel import ParallelLayout, build_groups

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        def failing(*args, **kwargs):
            raise RuntimeError("CUDA error: out of memory")

        monkeypatch.setattr(dist, "new_group", failing)
        with pytest.raises(RuntimeError, match=r"^CUDA error: out of memory$"):
            build_groups(ParallelLayout(dp=1), 4, timeout=timedelta(seconds=2))
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
