"""Peak RSS of prepare-data on one large document: training the BPE, and encoding with a given tokenizer.

    cd /work/main && uv run python packages/moe-train/bench/prepare_memory.py --mb 5 20 [--repeated-long-words]

Each size gets a synthetic single-document corpus (words, numbers, punctuation, long whitespace runs, newlines,
unicode, very long words) written to a temporary folder. Each phase runs in a fresh child process with two
tokenizer threads (RAYON_NUM_THREADS=2), which reports its own high-water mark (VmHWM) and how much it grew
above its RSS after importing moe_train.data:
  train   train_bpe(text_file_documents([corpus]), vocab) - the BPE trainer's pass over the text
  encode  moe-train prepare-data corpus --tokenizer T --out D - reading, encoding, splitting (no training)
Prints one JSON line per size and phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, re, sys, time
import moe_train.data  # numpy, tokenizers: loaded before the baseline
from moe_train.cli import main
from moe_train.data import text_file_documents, train_bpe
def status(key): return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
base, t = status("VmRSS"), time.perf_counter()
phase, corpus, tok, out = sys.argv[1:5]
if phase == "train":
    train_bpe(text_file_documents([corpus]), 4096)
else:
    assert main(["prepare-data", corpus, "--tokenizer", tok, "--out", out]) == 0
print(json.dumps({"base": base, "peak": status("VmHWM"), "seconds": time.perf_counter() - t}))
"""


def synthetic_document(n_chars: int, seed: int = 0, unique_long_words: bool = True) -> str:
    """One document of about n_chars characters of mixed text. unique_long_words: its very long words (base64-like,
    runs of CJK and emoji; ~2/3 of the characters) are all different, so the BPE trainer's word counts grow with
    the text (its own memory, not the pipeline's); else they are drawn from a fixed set of 300."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    long_words = ["".join(rng.choices(letters + "0123456789+/=", k=rng.randint(200, 4000))) for _ in range(200)]
    long_words += ["".join(rng.choices("日本語中文字😀é", k=rng.randint(100, 3000))) for _ in range(100)]
    words = ["".join(rng.choices(letters, k=rng.randint(1, 12))) for _ in range(5000)]
    words += ["δέλτα", "日本語の文章", "Ünïcödé", "😀🚀", "naïve", "Ωμέγα", "한국어", "العربية"]
    punct = [".", ",", ";", ":", "!", "?", "(", ")", "\"", "'s", "'re", "--", "...", "{}", "[]", "#", "=>"]
    parts, size = [], 0
    while size < n_chars:
        r = rng.random()
        if r < 0.70:
            s = rng.choice(words) + " "
        elif r < 0.78:
            s = str(rng.randint(0, 10**rng.randint(1, 12))) + rng.choice([" ", ", "])
        elif r < 0.88:
            s = rng.choice(punct) + rng.choice(["", " "])
        elif r < 0.95:
            s = "\n" * rng.randint(1, 3)
        elif r < 0.985:
            s = rng.choice([" ", "\t", "\n", "  \n"]) * rng.randint(2, 300)
        elif not unique_long_words:
            s = rng.choice(long_words) + rng.choice([" ", "\n"])
        elif r < 0.998:
            s = "".join(rng.choices(letters + "0123456789+/=", k=rng.randint(200, 4000))) + " "  # base64-like
        else:
            s = "".join(rng.choices("日本語中文字😀é", k=rng.randint(100, 3000))) + "\n"
        parts.append(s)
        size += len(s)
    return "".join(parts)


def run(phase: str, corpus: Path, tok: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, phase, str(corpus), str(tok), str(out)], capture_output=True,
                          text=True, env={**os.environ, "RAYON_NUM_THREADS": "2"})
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[5, 20], help="corpus sizes, in millions of characters")
    ap.add_argument("--repeated-long-words", action="store_true",
                    help="draw the very long words from a fixed set (else all differ: the trainer's counts grow)")
    args = ap.parse_args()
    from moe_train.data import train_bpe  # the tokenizer the encode phase uses, trained on a small sample

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_bpe([synthetic_document(300_000, seed=1)], 4096).save(str(tmp / "tok.json"))
        for mb in args.mb:
            corpus = tmp / "corpus.txt"
            text = synthetic_document(int(mb * 1e6), unique_long_words=not args.repeated_long_words)
            corpus.write_text(text, encoding="utf-8")
            chars, nbytes = len(text), corpus.stat().st_size
            del text
            for phase in ("train", "encode"):
                t = time.perf_counter()
                r = run(phase, corpus, tmp / "tok.json", tmp / "out")
                growth = r["peak"] - r["base"]
                print(json.dumps({"chars": chars, "bytes": nbytes, "phase": phase,
                                  "peak_rss_mb": round(r["peak"] / 2**20), "growth_mb": round(growth / 2**20),
                                  "growth_bytes_per_char": round(growth / chars, 1), "seconds": round(r["seconds"], 1),
                                  "wall": round(time.perf_counter() - t, 1)}), flush=True)


if __name__ == "__main__":
    main()
