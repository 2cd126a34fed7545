"""A payload codec whose rows travel as float8_e4m3fn, for the dispatcher tests (CPU, gloo and NCCL alike): lossy,
its gradient travels back as fp8 too and is cast up for the rows (a straight-through cast). gloo has no one-byte
float: moe-kernels <= 0.9.11 failed there with "Invalid scalar type"; 0.9.12 exchanges such rows as their bytes."""

from __future__ import annotations

import torch


class _Fp8StraightThrough(torch.autograd.Function):
    """rows -> float8_e4m3fn; the payload's fp8 gradient cast up for the rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return rows.to(torch.float8_e4m3fn)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad.float()


class Fp8Codec:
    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return _Fp8StraightThrough.apply(rows)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.float()
