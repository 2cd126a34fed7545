"""Peak RSS and wall time of the data path's commands as the corpus grows (QA 124).

    cd /work/main && .venv/bin/python tools/data_scaling.py --sizes-mb 10 40 100 200 --work /tmp/qa124/scaling
    .venv/bin/python tools/data_scaling.py --sizes-mb --synthetic-tokens 1e8 1e9 1e10   # start-up on sparse files

Per corpus size and layout (`files`: ~20 KB documents in folders of 1,000; `single`: one document of the whole
size), a synthetic corpus is written (Zipf-distributed words of a 60K-word vocabulary in five scripts: ASCII,
accented Latin, Greek, Cyrillic, CJK; numbers, punctuation, emoji, newlines), and each command runs as its own
child process (`python -m moe_train ...`, RAYON_NUM_THREADS=2), its peak RSS taken from os.wait4's rusage:
  prepare_bpe      prepare-data CORPUS --out D          (trains the BPE, then encodes)
  prepare_tok      prepare-data CORPUS --tokenizer T --out D   (T: the BPE of a fixed 2 MB corpus)
  train_startup    train --data.path=D --train.steps=1, no eval, no save
  train_eval       the same with an eval of --eval-windows windows at steps 0 and 1, and a save
  inspect_run      inspect RUN (the train_eval run)
  inspect_data     inspect D (a data folder: refused, rc recorded)
--synthetic-tokens N writes a data folder of N zero tokens (a sparse train.u32, meta.json with max_token_id, so
nothing reads the tokens) and runs train_startup on it: what start-up costs at 10^9 tokens and beyond.
Prints one JSON object: {"rows": [{size_mb, layout, tokens, command: {rss_mb, seconds, rc}}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ENV = {**os.environ, "RAYON_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore"}
TRAIN = ["--model.vocab_size=4096", "--train.steps=1", "--train.log_interval=1"]


def vocabulary(rng: np.random.Generator, n: int = 60_000) -> np.ndarray:
    """n word types of 1-4 syllables in five scripts (ASCII, accented Latin, Greek, Cyrillic, CJK), plus emoji and
    numbers; `text` draws rank r with p ~ 1/(r + 2.7), a Zipf law as in natural text."""
    scripts = [("bcdfghklmnprstvwz", "aeiou"), ("bcdlmnrstvz", "aeéèàüöäiou"), ("βγδζθκλμνπρστφχ", "αεηιουω"),
               ("бвгджзклмнпрстфхцчш", "аеиоуыэюя"), ("的一是不了人我在有他这中大来上国个到说们为子和你地", "")]
    syllables = [[c + v for c in cs for v in (vs or [""])] for cs, vs in scripts]
    which = rng.choice(len(scripts), size=n, p=[0.62, 0.12, 0.08, 0.1, 0.08])
    lengths = rng.integers(1, 5, size=n)
    words = ["".join(rng.choice(syllables[s], size=k)) for s, k in zip(which, lengths)]
    words[:12] = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "with"]
    return np.array(words + ["😀", "🚀", "naïve", "Ünïcödé", "日本語の文章"] + [str(i) for i in range(0, 100_000, 37)],
                    dtype=object)


def text(rng: np.random.Generator, words: np.ndarray, n_chars: int) -> str:
    """About n_chars characters of Zipf-distributed words, separators and punctuation."""
    p = 1.0 / (np.arange(words.size) + 2.7)
    p /= p.sum()
    seps = np.array([" "] * 14 + [", ", ". ", ".\n", "\n", "; ", " (", ") ", "\n\n", ": ", "? ", "! "], dtype=object)
    parts, size = [], 0
    while size < n_chars:
        n = min(100_000, (n_chars - size) // 4 + 16)
        s = "".join(map(str.__add__, words[rng.choice(words.size, size=n, p=p)], rng.choice(seps, size=n)))
        parts.append(s)
        size += len(s)
    return "".join(parts)[:n_chars]


def write_corpus(root: Path, size_mb: float, layout: str, seed: int) -> Path:
    """The corpus of `layout` at root (written a piece at a time: the generator never holds it whole)."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    words = vocabulary(rng)
    target, written = int(size_mb * 1e6), 0
    if layout == "single":
        with open(root / "all.txt", "w", encoding="utf-8") as f:
            while written < target:
                chunk = text(rng, words, min(4_000_000, target - written))
                written += len(chunk.encode())
                f.write(chunk)
        return root / "all.txt"
    i = 0
    while written < target:
        doc = text(rng, words, int(rng.lognormal(np.log(15_000), 0.8)) + 1)
        path = root / f"{i // 1000:04d}" / f"doc{i:06d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(doc, encoding="utf-8")
        written += len(doc.encode())
        i += 1
    return root


def measure(args: list[str], timeout: float = 3600) -> dict:
    """One command in a child process: its peak RSS (MB, from the child's own rusage), seconds and exit status."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "moe_train", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    result = {"rss_mb": round(usage.ru_maxrss / 1024, 1), "seconds": round(time.perf_counter() - t, 2),
              "rc": proc.returncode}
    if proc.returncode:
        result["tail"] = out.strip().splitlines()[-1:] if out.strip() else []
    return result


def train_commands(row: dict, data: Path, work: Path, eval_windows: int) -> None:
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    row["train_startup"] = measure(["train", f"--data.path={data}", f"--train.run_dir={run}", *TRAIN,
                                    "--train.eval_interval=0", "--train.save_interval=0"])
    shutil.rmtree(run, ignore_errors=True)
    row["train_eval"] = measure(["train", f"--data.path={data}", f"--train.run_dir={run}", *TRAIN,
                                 "--train.eval_interval=1", f"--train.eval_windows={eval_windows}",
                                 "--train.save_interval=1"])
    row["inspect_run"] = measure(["inspect", str(run)])
    row["inspect_data"] = measure(["inspect", str(data)])
    shutil.rmtree(run, ignore_errors=True)


def synthetic_folder(folder: Path, num_tokens: int, doc_tokens: int, eval_tokens: int = 1 << 16) -> None:
    """A data folder of num_tokens zeros, as token_file.py defines it: sparse train.u32 and train.docs.u64 (no disk
    used; a document end every doc_tokens), meta.json recording max_token_id (so opening it reads no token)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    splits = {}
    for name, n in (("train", num_tokens), ("eval", eval_tokens)):
        docs = max(1, n // doc_tokens)
        for suffix, size in (("u32", 4 * n), ("docs.u64", 8 * docs)):
            with open(folder / f"{name}.{suffix}", "wb") as f:
                f.truncate(size)
        splits[name] = {"num_tokens": n, "num_docs": docs, "max_token_id": 0}
    meta = {"format": "moe-train-tokens/1", "vocab_size": 4096, "eos_id": 0, "splits": splits}
    (folder / "meta.json").write_text(json.dumps(meta))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="*", default=[10, 40, 100, 200])
    p.add_argument("--layouts", nargs="+", default=["files", "single"], choices=["files", "single"])
    p.add_argument("--work", type=Path, default=Path("/tmp/qa124/scaling"))
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--skip-bpe", action="store_true", help="leave out prepare_bpe (the slowest command)")
    p.add_argument("--synthetic-tokens", type=float, nargs="*", default=[])
    p.add_argument("--synthetic-doc-tokens", type=int, default=1000, help="tokens a document in a synthetic folder")
    args = p.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.sizes_mb:
        tokenizer_corpus = write_corpus(work / "tok_corpus", 2, "files", seed=1)
        measure(["prepare-data", str(tokenizer_corpus), "--out", str(work / "tok_data")])
        tokenizer = work / "tokenizer.json"
        shutil.copy(work / "tok_data" / "tokenizer.json", tokenizer)
    for size in args.sizes_mb:
        for layout in args.layouts:
            corpus = write_corpus(work / "corpus", size, layout, seed=0)
            row: dict = {"size_mb": size, "layout": layout}
            if not args.skip_bpe:
                row["prepare_bpe"] = measure(["prepare-data", str(corpus), "--out", str(work / "data_bpe")])
                shutil.rmtree(work / "data_bpe", ignore_errors=True)
            data = work / "data"
            row["prepare_tok"] = measure(["prepare-data", str(corpus), "--tokenizer", str(tokenizer),
                                          "--out", str(data)])
            shutil.rmtree(work / "corpus")
            meta = json.loads((data / "meta.json").read_text())
            row["tokens"] = sum(s["num_tokens"] for s in meta["splits"].values())
            row["docs"] = sum(s["num_docs"] for s in meta["splits"].values())
            train_commands(row, data, work, args.eval_windows)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    for n in args.synthetic_tokens:
        data = work / "synthetic"
        synthetic_folder(data, int(n), args.synthetic_doc_tokens)
        row = {"synthetic_tokens": int(n), "doc_tokens": args.synthetic_doc_tokens, "train_startup": measure(
            ["train", f"--data.path={data}", f"--train.run_dir={work / 'run'}", *TRAIN, "--train.eval_interval=0",
             "--train.save_interval=0"])}
        shutil.rmtree(work / "run", ignore_errors=True)
        shutil.rmtree(data)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    shutil.rmtree(work / "data", ignore_errors=True)
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
