"""Regenerate the run folders of older moe-train releases that tests/test_qa106.py resumes, inspects, exports and
starts from with the current code.

    python packages/moe-train/tests/data/old_runs/make_old_runs.py            # from the repository root

Each version's code is taken from git history (`git archive COMMIT packages`, nothing checked out) and run with
this interpreter (PYTHONPATH = that tree's packages/*/src), from this folder (data.path and train.run_dir are
relative, so the runs' stored configs name `data` and `<version>` wherever the folder is copied). Written here:

- data/: a synthetic corpus (4 files of 5 documents of common English words, random.Random(106)) tokenized by
  moe-train 0.5.0's own `prepare-data --vocab-size 264` (commit 9fbaecc): the old folder format (meta.json without
  the largest token ids).
- <version>/: `moe-train train --preset tiny` with the overrides in COMMON plus the run's own, 6 steps, saving
  every 2 (keep_last=2), eval every 2 steps; then checkpoints/step-00000006 is deleted and `latest` points at
  step-00000004, as a run that died after step 4's save leaves it; index.json and metadata.json are rewritten
  without indentation (the same JSON) and a run lock (.lock) is removed. metrics.jsonl keeps what the old version logged
  for steps 5 and 6 (and the eval at 6): the old version's own continuation, which a resume must reproduce.

  0.5.0   9fbaecc  1 process, fp32 (LocalRuntime), learned routing
  0.9.0   c489331  1 process, parallel.param_dtype=bf16 (DistributedRuntime at world 1: bf16 weights, fp32 masters
                   in the optimizer), model.router.routing=random (the generators' saved state matters),
                   model.tie_embeddings=true
  0.12.0  0587659  2 gloo ranks under torchrun, parallel.dp=2 parallel.ep=2 (micro_batch_size 1: the same global
                   batch), learned routing

A checkpoint's metadata.json `moe_ckpt.writer` names the moe-ckpt installed in the interpreter's environment (the
old code reads it from importlib.metadata), not the archived one: only people read that field.
Regenerated folders differ from the kept ones only in timings (tokens_per_s, saved_at).
(0.15.0, 0.17.0 and 0.19.0 were checked by hand and are not kept, to keep this folder near 400 KB.)
Sizes: 110-150 KB a run folder (the fp32 weights and AdamW state of a ~2.5K-parameter model, the index of its
pieces and the generators' state in metadata.json).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = Path(subprocess.run(["git", "-C", str(HERE), "rev-parse", "--show-toplevel"], check=True,
                           capture_output=True, text=True).stdout.strip())
DATA_COMMIT = "9fbaecc"  # moe-train 0.5.0

COMMON = [
    "--preset", "tiny", "--model.vocab_size=264", "--model.d_model=4", "--model.num_layers=2", "--model.num_heads=2",
    "--model.num_kv_heads=1", "--model.dense_hidden=16", "--model.num_experts=4", "--model.expert_hidden=8",
    "--data.path=data", "--data.seq_len=16", "--train.steps=6", "--train.warmup_steps=2", "--train.eval_interval=2",
    "--train.eval_windows=4", "--train.log_interval=1", "--train.save_interval=2", "--train.keep_last=2",
    "--train.progress=false", "--train.device=cpu",
]

RUNS = {  # version: (commit, ranks, overrides)
    "0.5.0": ("9fbaecc", 1, ["--train.micro_batch_size=2"]),
    "0.9.0": ("c489331", 1, ["--train.micro_batch_size=2", "--parallel.param_dtype=bf16",
                             "--model.router.routing=random", "--model.tie_embeddings=true"]),
    "0.12.0": ("0587659", 2, ["--train.micro_batch_size=1", "--parallel.dp=2", "--parallel.ep=2",
                              "--parallel.backend=gloo"]),
}

WORDS = ("the a of to and in is that for it as with was on be by this are or from at an which have not but were all "
         "one can there their so more when will if no out up what into about time these some two may like than other "
         "only then first new would been its made our over also any after most such where through years back much "
         "many well down").split()


def checkout(commit: str, into: Path) -> str:
    """`git archive COMMIT packages` unpacked under `into`; returns the PYTHONPATH of its packages' src folders."""
    archive = ["git", "-C", str(REPO), "archive", commit, "packages"]
    tar = subprocess.run(archive, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return os.pathsep.join(str(p) for p in sorted((into / "packages").glob("*/src")))


def run(cmd: list[str], pythonpath: str, cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=cwd, env=env)


def make_data(tmp: Path) -> None:
    r = random.Random(106)
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(4):
        docs = [" ".join(r.choice(WORDS) for _ in range(r.randint(30, 90))).capitalize() + "." for _ in range(5)]
        (corpus / f"part{i}.txt").write_text("\n\n".join(docs) + "\n")
    pp = checkout(DATA_COMMIT, tmp / DATA_COMMIT)
    shutil.rmtree(HERE / "data", ignore_errors=True)
    run([sys.executable, "-m", "moe_train", "prepare-data", "corpus", "--out", "data", "--vocab-size", "264"], pp, tmp)
    shutil.move(str(tmp / "data"), HERE / "data")


def make_run(version: str, tmp: Path) -> None:
    commit, ranks, extra = RUNS[version]
    pp = checkout(commit, tmp / commit)
    shutil.rmtree(HERE / version, ignore_errors=True)
    launch = ([sys.executable, "-m", "moe_train"] if ranks == 1 else
              [str(Path(sys.executable).with_name("torchrun")), f"--nproc-per-node={ranks}", "-m", "moe_train"])
    run(launch + ["train", *COMMON, *extra, f"--train.run_dir={version}"], pp, HERE)
    ckpts = HERE / version / "checkpoints"
    shutil.rmtree(ckpts / "step-00000006")  # the run died after step 4's save: its records of 5 and 6 stay
    (ckpts / "latest").write_text("step-00000004\n")
    for name in ("index.json", "metadata.json"):  # the same JSON without its indentation: a third of the bytes
        f = ckpts / "step-00000004" / name
        f.write_text(json.dumps(json.loads(f.read_text()), separators=(",", ":")))
    (HERE / version / ".lock").unlink(missing_ok=True)  # the run lock of versions that take one


def main() -> None:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        make_data(tmp)
        for version in RUNS:
            make_run(version, tmp)


if __name__ == "__main__":
    main()
