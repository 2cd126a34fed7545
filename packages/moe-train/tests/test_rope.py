"""Rotary embeddings: the torch reference against rotation by complex numbers, and the fused kernel
against the reference (forward and backward) under Triton's CPU interpreter (fp32) and on the GPU; partial
rotary (GLM-4.5) against transformers' Glm4Moe, and through the fused kernel."""

import os
import subprocess
import sys

import pytest
import torch

from moe_train.model.rope import apply_rope, rope_reference, rope_tables

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_reference_is_a_rotation_of_each_frequency_pair():
    b, h, s, hd = 2, 3, 7, 12
    x = torch.randn(b, h, s, hd, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cos, sin = rope_tables(s, hd, 500.0, torch.device("cpu"))
    out = rope_reference(x, cos.double(), sin.double())
    # rotate-half pairs element i with i + hd/2; position p rotates pair i by p * theta^(-2i/hd)
    inv = 500.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * inv
    z = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], dim=-1), rtol=1e-6, atol=1e-6)


def _parity(device: str, dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator(device=device).manual_seed(1)
    for b, s, h, hd in [(2, 37, 3, 8), (1, 5, 4, 96), (3, 64, 2, 128), (1, 1, 1, 2)]:
        cos, sin = rope_tables(s, hd, 10000.0, torch.device(device))
        # q as the attention makes it: [B, S, H, hd] transposed to [B, H, S, hd] (not contiguous)
        base = torch.randn(b, s, h, hd, generator=g, device=device).to(dtype)
        x = base.transpose(1, 2).requires_grad_()
        x_ref = base.detach().clone().transpose(1, 2).requires_grad_()
        out, ref = apply_rope(x, cos, sin), rope_reference(x_ref, cos, sin)
        assert out.dtype == dtype and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        gy = torch.randn(out.shape, generator=g, device=device).to(dtype)
        out.backward(gy)
        ref.backward(gy)
        torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=tol, atol=tol)


def _under_the_triton_interpreter(parity: str, kernel_calls: int) -> None:
    """Run test_rope.<parity>('cpu', fp32) in a process with TRITON_INTERPRET=1, counting the kernel's launches."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    code = ("import torch, moe_train.model.rope as r\n"
            f"from test_rope import {parity}\n"
            "assert r.triton_can_run_on(torch.zeros(1))\n"
            "calls = []\n"
            "kernel = r._rope_kernel\n"
            "r._rope_kernel = type('Spy', (), {'__getitem__': lambda self, g: (calls.append(g), kernel[g])[1]})()\n"
            f"{parity}('cpu', torch.float32, 1e-5)\n"
            f"assert len(calls) == {kernel_calls}, calls\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_fused_kernel_matches_reference_under_the_triton_interpreter():
    _under_the_triton_interpreter("_parity", 8)  # forward and backward of each shape ran the kernel


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_kernel_matches_reference_on_gpu(dtype, tol):
    _parity("cuda", dtype, tol)


def test_partial_rotary_turns_the_leading_dims_as_transformers_glm4_moe():
    """GLM-4.5 (partial_rotary_factor 0.5): transformers' Glm4Moe rotates the first int(head_dim x factor) dims,
    rotate-half within them (pairs i, i + rd/2, not interleaved), frequencies over rd; the rest pass."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    b, h, s, hd, rd = 2, 3, 7, 16, 8
    cfg = transformers.Glm4MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=hd, rope_parameters={
        "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": rd / hd})
    x = torch.randn(b, h, s, hd, generator=torch.Generator().manual_seed(0))
    cos_hf, sin_hf = glm.Glm4MoeRotaryEmbedding(cfg)(x, torch.arange(s)[None])
    cos, sin = rope_tables(s, rd, 500.0, torch.device("cpu"))
    torch.testing.assert_close(cos, cos_hf[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_hf[0], rtol=0, atol=0)
    want, _ = glm.apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[..., rd:], x[..., rd:]) and not torch.allclose(out[..., :rd], x[..., :rd])


def _partial_parity(device: str, dtype: torch.dtype, tol: float) -> None:
    """apply_rope with tables for the leading rd dims against the reference on them, the rest passed through;
    forward and backward."""
    g = torch.Generator(device=device).manual_seed(2)
    for b, s, h, hd, rd in [(2, 37, 3, 16, 8), (1, 5, 4, 128, 64), (1, 3, 2, 10, 4)]:
        cos, sin = rope_tables(s, rd, 10000.0, torch.device(device))
        base = torch.randn(b, s, h, hd, generator=g, device=device).to(dtype)
        x = base.transpose(1, 2).requires_grad_()
        x_ref = base.detach().clone().transpose(1, 2).requires_grad_()
        out = apply_rope(x, cos, sin)
        ref = torch.cat([rope_reference(x_ref[..., :rd], cos, sin), x_ref[..., rd:]], dim=-1)
        assert out.dtype == dtype and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        gy = torch.randn(out.shape, generator=g, device=device).to(dtype)
        out.backward(gy)
        ref.backward(gy)
        torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=tol, atol=tol)


def test_partial_rotary_fused_kernel_matches_reference_under_the_triton_interpreter():
    _under_the_triton_interpreter("_partial_parity", 6)  # forward and backward of each shape, on the rotated part


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_partial_rotary_fused_kernel_matches_reference_on_gpu(dtype, tol):
    _partial_parity("cuda", dtype, tol)
