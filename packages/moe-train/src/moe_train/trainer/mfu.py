"""Peak dense bf16 tensor throughput by GPU name, for MFU. No entry means no MFU (e.g. CPU)."""

from __future__ import annotations

import torch

# Dense (non-sparse) bf16 peaks in TFLOP/s from the vendors' datasheets.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("B300", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
]


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_TFLOPS:
        if key in name:
            return peak
    return None
