"""Peak dense bf16 tensor throughput by GPU name, for MFU. No entry means no MFU (e.g. CPU)."""

from __future__ import annotations

import re

import torch

from moe_train.config import Config

# Dense (non-sparse) bf16 peaks in TFLOP/s from the vendors' datasheets (half their "with sparsity" figures).
# A key matches a whole word of the device name ("NVIDIA H100 80GB HBM3"): GH200 is not H200, GB200 not B200,
# RTX A1000 not A100. The first match wins, so a variant with its own peak comes before its family's name.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("GB300", 2500.0),  # Grace-Blackwell Ultra (1.4 kW)
    ("GB200", 2500.0),  # Grace-Blackwell (1.2 kW); the HGX B200 runs at 1 kW
    ("B300", 2250.0),  # HGX B300: the same bf16 peak as B200 (Blackwell Ultra adds FP4, not bf16)
    ("B200", 2250.0),
    ("GH200", 989.0),  # Grace-Hopper: an H100-class GPU
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
]


def peak_for_name(name: str) -> float | None:
    """The dense bf16 peak (TFLOP/s) of the GPU called `name` (torch.cuda.get_device_name), None if unknown."""
    for key, peak in PEAK_BF16_TFLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return peak
    return None


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def gemm_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The dtype a run's GEMMs run in: bf16 under bf16 autocast (train.autocast_bf16, on a GPU) or with bf16
    resident weights (parallel.param_dtype=bf16), else fp32."""
    autocast = device.type == "cuda" and cfg.train.autocast_bf16
    return torch.bfloat16 if autocast or cfg.parallel.param_dtype == "bf16" else torch.float32


def run_peak_tflops(cfg: Config, device: torch.device) -> float | None:
    """The peak a run's MFU is measured against: the device's dense bf16 peak when its GEMMs run in bf16, None
    (no MFU) when they run in fp32 (train.autocast_bf16=false with fp32 weights): fp32 GEMMs cannot reach the
    bf16 tensor-core peak (H100 SXM: 989 bf16, 67 fp32), so an MFU against it read about 15x too low."""
    return peak_tflops(device) if gemm_dtype(cfg, device) == torch.bfloat16 else None
