"""Does a long `moe-train train` stay healthy? Runs the real CLI on a tiny model and prints a JSON summary.

Phases, all in one run folder under --root (a scratch folder, wiped first):
  long     --steps steps from scratch, with eval / log / save every few steps (keep_last small)
  resumes  --resumes resumes of the same folder, each --resume-steps further
  sigint   a resume stopped by SIGINT as soon as a step-N.tmp save folder appears, then a resume to the end
  sigkill  the same with SIGKILL, then a resume
  ranks2   (--ranks2-steps > 0) a fresh run on 2 gloo ranks through torchrun, sampled per rank

Per phase: RSS / open fds / threads of each training process at fixed step marks, the training step time (from
metrics.jsonl's tokens/s: eval and saves excluded) in the first and last tenth of the run, the most checkpoint
folders seen at once against keep_last, and the run folder's leftovers (a name with ".tmp" in it) during and after.
A separate run of --strace-steps steps runs under strace: the bytes written to (and read from) each file of the run
folder, against its final size per save (1: written once; a file rewritten whole each step or save: many times it).

    .venv/bin/python tools/long_run_hygiene.py --data /tmp/qa123/data --root /tmp/qa123/hyg --steps 3000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

TINY = {  # the tiny preset shrunk further: a step is a few ms on one CPU thread
    "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 2, "model.num_kv_heads": 1, "model.dense_hidden": 64,
    "model.num_experts": 4, "model.expert_hidden": 32, "data.seq_len": 32, "train.micro_batch_size": 2,
    "train.eval_windows": 2, "train.warmup_steps": 5, "train.threads": 1, "train.progress": "false",
}


def train_cmd(args, run_dir: Path, steps: int, ranks: int = 1) -> list[str]:
    vocab = json.loads((Path(args.data) / "meta.json").read_text())["vocab_size"]
    over = {**TINY, "data.path": args.data, "model.vocab_size": vocab, "train.steps": steps, "train.run_dir": run_dir,
            "train.eval_interval": args.eval_interval, "train.log_interval": args.log_interval,
            "train.save_interval": args.save_interval, "train.keep_last": args.keep_last}
    flags = [f"--{k}={v}" for k, v in over.items()]
    py = sys.executable
    if ranks == 1:
        return [py, "-m", "moe_train", "train", *flags]
    torchrun = [py, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", "29533"]
    return [*torchrun, "-m", "moe_train", "train", *flags, f"--parallel.dp={ranks}"]


def proc_stats(pid: int) -> dict[str, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # exiting (a zombie)
        return None
    return {"rss_kib": int(fields["VmRSS"].split()[0]), "fds": fds, "threads": int(fields["Threads"])}


def trainers(root_pid: int, nested: bool) -> list[int]:
    """The training processes: the CLI itself, or the children of its launcher (torchrun's ranks, strace's CLI)."""
    if not nested:
        return [root_pid]
    kids = Path(f"/proc/{root_pid}/task/{root_pid}/children")
    try:
        return sorted(int(p) for p in kids.read_text().split())
    except FileNotFoundError:
        return []


def last_step(metrics: Path) -> int:
    """The step of metrics.jsonl's last step record (0 before any); reads only the file's tail."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return 0
    for line in reversed(lines[:-1]):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "event" not in rec and isinstance(rec.get("step"), int):
            return rec["step"]
    return 0


def leftovers(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if ".tmp" in p.name)


def run_phase(args, cmd: list[str], run_dir: Path, nested: bool = False, stop_on_save=None) -> dict:
    """Run `cmd`, sampling its training processes every few ms. stop_on_save: a signal sent as soon as a
    step-N.tmp folder appears under checkpoints/ (a save in flight)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, ckpts = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    try:  # the step resumed from: records up to it (or past it, until the rewind drops them) are earlier runs'
        start = int((ckpts / "latest").read_text().strip().removeprefix("step-"))
    except FileNotFoundError:
        start = 0
    before, started_logging = last_step(metrics), False  # an earlier run's last record, until this one logs
    samples: dict[int, list[tuple[int, dict]]] = {}  # rank index -> [(step, stats)]
    max_ckpts, tmp_seen, signalled = 0, set(), None
    while proc.poll() is None:
        step = last_step(metrics)
        started_logging = started_logging or step != before
        step = max(0, step - start) if started_logging else 0
        for i, pid in enumerate(trainers(proc.pid, nested)):
            if (s := proc_stats(pid)) is not None:
                samples.setdefault(i, []).append((step, s))
        if ckpts.is_dir():
            names = [p.name for p in ckpts.iterdir()]
            max_ckpts = max(max_ckpts, sum(re.fullmatch(r"step-\d{8}", n) is not None for n in names))
            tmps = {n for n in names if ".tmp" in n}
            tmp_seen |= tmps
            if stop_on_save is not None and signalled is None and any(n.endswith(".tmp") for n in tmps):
                os.kill(proc.pid, stop_on_save)
                signalled = {"signal": signal.Signals(stop_on_save).name, "at_step": step, "during": sorted(tmps)}
        time.sleep(0.002 if stop_on_save is not None else 0.02)
    err = proc.stderr.read()
    out = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - started, 2),
           "stderr_tail": err.strip().splitlines()[-1:] if proc.returncode else [],
           "max_checkpoints_seen": max_ckpts, "keep_last": args.keep_last, "tmp_names_seen": sorted(tmp_seen),
           "leftovers_after": leftovers(run_dir), "per_rank": {}}
    if signalled:
        out["signalled"] = signalled
    for i, rows in samples.items():
        out["per_rank"][i] = marks(rows)
    return out


def marks(rows: list[tuple[int, dict]]) -> dict:
    """The first sample at or after 10/25/50/75/100% of the phase's steps (RSS, fds, threads), the growth from
    the 10% mark to the last step, and the largest of each over the training steps (the exit is left out)."""
    top = max(step for step, _ in rows)
    if top == 0:
        return {"no_step_logged": rows[-1][1]}
    picks = {}
    for frac in (0.1, 0.25, 0.5, 0.75, 1.0):
        mark = max(1, int(top * frac))
        picks[mark] = next(s for step, s in rows if step >= mark)
    first, last = picks[min(picks)], picks[top]
    training = [s for step, s in rows if 0 < step < top] + [picks[top]]
    return {"at_step": picks, "growth_10pct_to_end": {k: last[k] - first[k] for k in last},
            "max_while_training": {k: max(s[k] for s in training) for k in last}}


def step_times(metrics: Path, tokens_per_step: int, since_step: int = 0) -> dict:
    """Training seconds per step (tokens/s of each log window, eval and saves excluded): first vs last tenth."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [(r["step"], tokens_per_step / r["tokens_per_s"]) for r in recs
            if "tokens_per_s" in r and "event" not in r and r["step"] > since_step]
    n = max(1, len(rows) // 10)
    early = statistics.median(t for _, t in rows[:n])
    late = statistics.median(t for _, t in rows[-n:])
    return {"windows": len(rows), "early_ms": round(early * 1e3, 3), "late_ms": round(late * 1e3, 3),
            "late_over_early": round(late / early, 3)}


def final_name(path: str) -> str:
    """The file a temporary one becomes: step-N.tmp/.index.json.tmp-123 -> step-N/index.json."""
    path = re.sub(r"step-\d{8}(\.tmp)?(?=/|$)", "step-N", path)
    return re.sub(r"(^|/)\.([^/]+)\.tmp-[0-9a-f]+$", r"\1\2", path)


def strace_bytes(log: Path, run_dir: Path, saves: int) -> dict:
    """{file under run_dir: bytes written and read, its final size, written / size} from an strace -y log; the
    files of a checkpoint are summed over every save (`saves` of them: written / size is then `saves` each)."""
    per: dict[str, dict[str, int]] = {}
    pat = re.compile(r"\b(write|pwrite64|writev|read|pread64)\(\d+<([^>]+)>.*\) = (\d+)$")
    root = str(run_dir.resolve())
    for line in log.read_text(errors="replace").splitlines():
        m = pat.search(line)
        if m and m.group(2).startswith(root + "/"):
            entry = per.setdefault(final_name(m.group(2)[len(root) + 1:]), {"written": 0, "read": 0})
            entry["read" if "read" in m.group(1) else "written"] += int(m.group(3))
    for name, entry in per.items():
        sizes = [p.stat().st_size for p in run_dir.glob(name.replace("step-N", "step-*")) if p.is_file()]
        entry["final_size"] = max(sizes, default=0)
        if entry["final_size"]:
            per_save = saves if "step-N" in name else 1
            entry["written_over_size"] = round(entry["written"] / entry["final_size"] / per_save, 2)
    return dict(sorted(per.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a prepare-data folder")
    ap.add_argument("--root", default="/tmp/qa123/hygiene", help="scratch folder (wiped first)")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--resumes", type=int, default=3)
    ap.add_argument("--resume-steps", type=int, default=200)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--log-interval", type=int, default=5)
    ap.add_argument("--save-interval", type=int, default=25)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--ranks2-steps", type=int, default=600)
    ap.add_argument("--strace-steps", type=int, default=1000, help="a run of this many steps under strace: bytes "
                    "read and written per file (0: none)")
    args = ap.parse_args()
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    run_dir = root / "run"
    tokens_per_step = TINY["train.micro_batch_size"] * TINY["data.seq_len"]
    summary: dict = {"args": vars(args)}

    summary["long"] = run_phase(args, train_cmd(args, run_dir, args.steps), run_dir)
    summary["long"]["step_time"] = step_times(run_dir / "metrics.jsonl", tokens_per_step)
    if args.strace_steps:  # a run folder of its own: strace slows the steps the long phase times
        traced = root / "traced"
        cmd = ["strace", "-f", "-qq", "--seccomp-bpf", "-y", "-e", "trace=write,pwrite64,writev,read,pread64",
               "-o", str(root / "strace.log"), *train_cmd(args, traced, args.strace_steps)]
        summary["traced"] = run_phase(args, cmd, traced, nested=True)
        summary["traced"]["bytes_per_file"] = strace_bytes(root / "strace.log", traced,
                                                          saves=args.strace_steps // args.save_interval)
    steps = args.steps
    for i in range(args.resumes):
        steps += args.resume_steps
        summary[f"resume{i + 1}"] = run_phase(args, train_cmd(args, run_dir, steps), run_dir)
    for name, sig in (("sigint", signal.SIGINT), ("sigkill", signal.SIGKILL)):
        steps += args.resume_steps
        summary[name] = run_phase(args, train_cmd(args, run_dir, steps), run_dir, stop_on_save=sig)
        summary[f"{name}_then_resume"] = run_phase(args, train_cmd(args, run_dir, steps), run_dir)
    summary["metrics_jsonl"] = metrics_check(run_dir / "metrics.jsonl", steps, args.log_interval)
    summary["run_dir_bytes"] = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    summary["run_dir_files"] = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    if args.ranks2_steps:
        r2 = root / "ranks2"
        summary["ranks2"] = run_phase(args, train_cmd(args, r2, args.ranks2_steps, ranks=2), r2, nested=True)
        summary["ranks2"]["step_time"] = step_times(r2 / "metrics.jsonl", 2 * tokens_per_step)
    print(json.dumps(summary, indent=1, default=str))


def metrics_check(path: Path, steps: int, log_interval: int) -> dict:
    """Each step of the log interval logged once across the resumes and kills; the events of the runs."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    logged = [r["step"] for r in recs if "event" not in r and "loss" in r]
    return {"bytes": path.stat().st_size, "lines": len(recs), "step_records": len(logged),
            "duplicate_steps": len(logged) - len(set(logged)),
            "missing_steps": sorted(set(range(log_interval, steps + 1, log_interval)) - set(logged)),
            "events": [r["event"] + ":" + str(r.get("status", "")) for r in recs if "event" in r]}


if __name__ == "__main__":
    main()
