"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

model_tflops_per_gpu (and mfu, its ratio to the peak) counts every rank's tokens, so it must be divided by the
world size: on one process the division is invisible, and the two-rank metric tests drop the field. Without it a
64-GPU run reports 64x its per-GPU throughput."""

from types import SimpleNamespace

import pytest
import torch

from moe_train.trainer.loop import Trainer


@pytest.mark.parametrize("world", [1, 4])
def test_model_tflops_per_gpu_is_the_job_rate_over_the_ranks(world):
    fake = SimpleNamespace(
        runtime=SimpleNamespace(world_size=world, rank=0, all_reduce_sum=lambda t: t),
        step=7, skipped_steps=0, flops_per_token=6e9, peak=100e12 / 1e12, device=torch.device("cpu"),
        model=SimpleNamespace(routers=lambda: []),
    )
    out = Trainer._window_metrics(fake, tokens=8000, seconds=2.0)
    assert out["tokens_per_s"] == 4000
    assert out["model_tflops_per_gpu"] == pytest.approx(6e9 * 4000 / world / 1e12)
    assert out["mfu"] == pytest.approx(out["model_tflops_per_gpu"] / fake.peak)
