"""Export a >= 1B-parameter MoE to a Hugging Face folder from a lazy tensor source; report time and peak RSS.

    uv run python packages/moe-ckpt/bench/export_large.py --out /tmp/hf-1b [--dtype bf16] [--shard-gib 2]

The source makes each tensor only when the exporter asks for it (seeded by name, so the run is
reproducible), the way a checkpoint reader streams tensors: nothing holds the whole model.
Peak RSS should stay near one shard plus one layer's expert tensor, far below the model's size.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
import zlib
from pathlib import Path

import torch

from moe_ckpt.hf import export_hf_folder, open_hf_folder
from moe_ckpt.hf.layout import build_plan
from provenance import source_commit  # this folder's (the script's own folder is first on sys.path)

MODEL = {  # Qwen3-MoE-shaped: 12 layers, d 2048, 16 experts of hidden 1024, top-2, layer 0 dense
    "vocab_size": 50_304, "d_model": 2048, "num_layers": 12, "num_heads": 16, "num_kv_heads": 8, "head_dim": None,
    "qk_norm": True, "rope_theta": 500_000.0, "norm_eps": 1e-6, "dense_hidden": 8192, "dense_layers": [0],
    "num_experts": 16, "expert_hidden": 1024, "shared_expert_hidden": 0, "tie_embeddings": False, "init_std": 0.02,
    "router": {"gating": "softmax", "top_k": 2, "normalize_top_k": True, "routing": "learned", "expert_bias": False},
}


def lazy_source(shapes: dict[str, tuple[int, ...]]):
    def get(name: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.empty(shapes[name]).normal_(0.0, 0.02, generator=g)
    return get


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/hf-export-1b")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--shard-gib", type=float, default=2.0)
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "hf_export_1b.json"))
    ap.add_argument("--keep", action="store_true", help="keep the exported folder")
    args = ap.parse_args()

    shapes = {e.ours: e.our_shape for e in build_plan(MODEL, "qwen3_moe") if e.ours}
    params = sum(torch.Size(s).numel() for s in shapes.values())
    rss_before = peak_rss_gib()
    summary = export_hf_folder(MODEL, lazy_source(shapes), args.out, dtype=args.dtype,
                               max_shard_bytes=int(args.shard_gib * 2**30))
    rss_export = peak_rss_gib()
    t0 = time.perf_counter()
    folder = open_hf_folder(args.out)  # re-reads every header and checks all names and shapes
    check_s = time.perf_counter() - t0
    result = {
        "model": "qwen3_moe-shaped, 12 layers, d 2048, 16 experts x 1024, top-2", "architecture": summary.architecture,
        "parameters": params, "dtype": args.dtype, "bytes_written": summary.total_bytes, "shards": summary.shards,
        "tensors": summary.num_tensors, "export_seconds": round(summary.seconds, 1),
        "write_gb_per_s": round(summary.total_bytes / summary.seconds / 1e9, 3),
        "peak_rss_gib": round(rss_export, 2), "peak_rss_before_export_gib": round(rss_before, 2),
        "fp32_model_gib": round(params * 4 / 2**30, 2), "header_check_seconds": round(check_s, 2),
        "torch_threads": torch.get_num_threads(), "imported_model_type": folder.model_type, "commit": source_commit(),
        "note": "tensor source generates each tensor on request (seeded by name); includes RNG time",
    }
    print(json.dumps(result, indent=2))
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(args.out)


if __name__ == "__main__":
    main()
