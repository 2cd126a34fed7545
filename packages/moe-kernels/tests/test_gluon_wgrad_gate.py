"""Where the Gluon wgrad is offered (CPU: the checks that decide it, not the kernel itself, which
needs an sm_90 GPU: test_gluon_wgrad_gpu.py runs it, and the fallback of a tuned Gluon choice
reused on operands it cannot take)."""

import pytest
import torch
import triton

from moe_kernels.triton import gluon_wgrad


@pytest.mark.parametrize("version,expected", [("3.6.0", True), ("3.6.1", True), ("3.5.1", False), ("3.9.0", False)])
def test_offered_only_on_the_triton_versions_it_was_checked_on(monkeypatch, version, expected):
    monkeypatch.setattr(triton, "__version__", version)
    assert gluon_wgrad.gluon_wgrad_available() == (expected and gluon_wgrad._HAVE_GLUON)


def test_never_offered_for_cpu_tensors(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    a = torch.zeros(64, 128, dtype=torch.bfloat16)
    b = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert not gluon_wgrad.gluon_wgrad_supports(a, b, torch.bfloat16, None)



@pytest.mark.parametrize("chunk_rows,stages", [(24, 4), (256, 2), (32, 1), (64, 4), (32, 7)])
def test_launch_refuses_pipelines_it_cannot_build(chunk_rows, stages):
    """Chunk heights off the MMA's steps, a ring of one stage, or more shared memory than an sm_90
    program has are named before anything is launched."""
    out = torch.zeros(1, 128, 256, dtype=torch.bfloat16)
    a = torch.zeros(64, 128, dtype=torch.bfloat16)
    b = torch.zeros(64, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"chunk_rows={chunk_rows}, stages={stages}"):
        gluon_wgrad.gluon_wgrad_launch(a, b, torch.tensor([64]), out, 1, chunk_rows=chunk_rows, stages=stages)


def test_tuning_candidates_fit_shared_memory():
    from moe_kernels.triton.grouped_gemm_kernels import _GLUON_WGRAD

    for cfg in _GLUON_WGRAD:
        assert gluon_wgrad.shared_bytes(cfg["chunk_rows"], cfg["stages"]) <= gluon_wgrad.SHARED_BYTES
