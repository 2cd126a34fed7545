"""The command-line journey on a GPU, as a user runs it: `moe-train train` (tiny preset on a prepared data folder),
the same through torchrun with one process (NCCL through torchrun's environment, bf16 resident weights), then
`moe-train export-hf` and stock transformers loading the export on the GPU and generating.

The CPU tests run every step of this journey, but never on CUDA and never with torchrun's NCCL rendezvous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_parallel_harness
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-4000:])
    return done


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_torchrun_export_and_transformers_on_the_gpu(tmp_path, data_dir):
    data = [f"--data.path={data_dir}", "--model.vocab_size=512", "--train.progress=false"]
    run(["-m", "moe_train", "train", "--train.steps=30", "--train.eval_interval=15", "--train.save_interval=30",
         f"--train.run_dir={tmp_path / 'one'}", *data], tmp_path)
    one = records(tmp_path / "one")
    start, end = one[0], one[-1]
    assert start["event"] == "start" and start["device"].startswith("cuda") and start["world_size"] == 1
    assert end["event"] == "end" and end["status"] == "completed" and end["step"] == 30
    evals = [r["eval_loss"] for r in one if "eval_loss" in r]
    assert len(evals) >= 3 and evals[-1] < evals[0], evals  # it learns
    steps = [r for r in one if "loss" in r and "event" not in r]
    assert steps and all(r["mfu"] is not None and r["mfu"] > 0 for r in steps if "mfu" in r)

    port = test_parallel_harness.free_port()
    run(["-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(port), "-m", "moe_train", "train", "--train.steps=10", "--parallel.param_dtype=bf16",
         "--train.save_interval=10", f"--train.run_dir={tmp_path / 'torchrun'}", *data], tmp_path)
    t = records(tmp_path / "torchrun")
    assert t[-1]["status"] == "completed" and t[-1]["step"] == 10 and t[0]["device"] == "cuda:0"

    run(["-m", "moe_train", "export-hf", str(tmp_path / "one"), str(tmp_path / "hf")], tmp_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).cuda().eval()
    ids = tok("def main(args):\n    return", return_tensors="pt").input_ids.cuda()
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.isfinite(logits).all() and logits.shape[-1] == 512
    assert out.shape[1] == ids.shape[1] + 8
