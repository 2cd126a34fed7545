"""Save / load throughput of moe-ckpt on local disk, and the async save's stall time.

    uv run python packages/moe-ckpt/bench/bench_io.py --gb 2 --out packages/moe-ckpt/bench/results/cpu_io.json

The state is `--tensors` fp32 tensors of equal size totalling `--gb` GB (1e9 bytes).
Every save includes the checksum, fsync of every file and the commit. Load times include
reading one element per page of everything returned (tensors read whole come back as
copy-on-write memory maps of the file, so an untouched load would cost nothing). "cold" loads
first evict the shard files from the page cache (posix_fadvise DONTNEED, no root
needed); "warm" loads read from the page cache.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import safetensors
import torch

from moe_ckpt import AsyncCheckpointer, Box, LoadRequest, ShardSpec, load_checkpoint, save_checkpoint, step_dir
from provenance import source_commit  # this folder's (the script's own folder is first on sys.path)


def make_state(gb: float, n: int, device: str) -> dict[str, torch.Tensor]:
    rows = int(gb * 1e9 / 4 / n / 1024)
    return {f"layers.{i}.w": torch.randn(rows, 1024, device=device) for i in range(n)}


def evict(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def touch(tensors) -> None:
    """Read one element per 4 KiB page: loads may return lazily mapped tensors (safetensors mmap)."""
    for t in tensors:
        t.reshape(-1)[::1024].sum()


def timed(fn) -> tuple[float, object]:
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next((int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem / 2**20, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "safetensors": safetensors.__version__, "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "commit": source_commit()}


def filesystem(path: Path) -> dict:
    best = ("", "?", "?")
    for line in open("/proc/mounts"):
        dev, mnt, fstype = line.split()[:3]
        if str(path).startswith(mnt) and len(mnt) > len(best[0]):
            best = (mnt, dev, fstype)
    return {"path": str(path), "mount": best[0], "device": best[1], "fstype": best[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="state size in GB (1e9 bytes), fp32")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: system tmp)")
    ap.add_argument("--checksum", default="crc32", choices=["crc32", "sha256"])
    ap.add_argument("--device", default="cpu", help="where the state lives (cuda: pinned async snapshots)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="moe-ckpt-bench-", dir=args.dir))
    load_start = os.getloadavg()
    state = make_state(args.gb, args.tensors, args.device)
    nbytes = sum(t.numel() * 4 for t in state.values())
    gb = nbytes / 1e9
    shards = [ShardSpec(n, tuple(t.shape), t) for n, t in state.items()]
    res: dict = {"bytes": nbytes, "tensors": len(state), "checksum": args.checksum, "device": args.device}
    try:
        dt, _ = timed(lambda: save_checkpoint(step_dir(scratch, 1), shards, {"step": 1}, checksum=args.checksum))
        res["save_sync"] = {"s": dt, "GB/s": gb / dt}
        ck = step_dir(scratch, 1)
        for name, verify, cold in [("load_cold_verify", True, True), ("load_cold_noverify", False, True),
                                   ("load_warm_verify", True, False), ("load_warm_noverify", False, False)]:
            if cold:
                evict(ck)
            dt, out = timed(lambda: (o := load_checkpoint(ck, verify=verify), touch(o.values()))[0])
            assert all(torch.equal(out[n], t.cpu()) for n, t in state.items())
            del out
            res[name] = {"s": dt, "GB/s": gb / dt}
        # what a trainer does on resume: copy into parameters it already has (warm cache)
        outs = {n: torch.empty_like(t, device="cpu") for n, t in state.items()}
        for o in outs.values():
            o.fill_(0)  # fault the pages in before timing
        dt, _ = timed(lambda: load_checkpoint(ck, [LoadRequest(n, out=o) for n, o in outs.items()], verify=False))
        res["load_warm_into_out"] = {"s": dt, "GB/s": gb / dt}
        del outs
        # reshard: 4 "ranks" each read a quarter of every tensor along dim 0 (cold cache)
        evict(ck)
        def quarters():
            for r in range(4):
                reqs = []
                for n, t in state.items():
                    q = t.shape[0] // 4
                    reqs.append(LoadRequest(n, region=Box.dim0(tuple(t.shape), r * q, q)))
                touch(load_checkpoint(ck, reqs, verify=False).values())
        dt, _ = timed(quarters)
        res["load_cold_4way_dim0"] = {"s": dt, "GB/s": gb / dt}

        acp = AsyncCheckpointer()
        for step in (2, 3):  # the first save allocates the snapshot buffers, the second reuses them
            t0 = time.perf_counter()
            acp.save(step_dir(scratch, step), shards, {"step": step}, checksum=args.checksum, keep_last_n=1)
            returned = time.perf_counter() - t0
            stats = acp.wait()
            res[f"async_save_{step - 1}"] = {"stall_s": stats.stall_s, "snapshot_s": stats.snapshot_s,
                                             "returned_after_s": returned, "write_s": stats.write_s,
                                             "write_GB/s": gb / stats.write_s}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["loadavg_start_end"] = [load_start, os.getloadavg()]
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "uv run python " + " ".join(shlex.quote(a) for a in sys.argv),
              "machine": machine(), "disk": filesystem(scratch.parent), "results": res}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
