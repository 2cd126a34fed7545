"""QA 124's corpora and child-process measurements (test_qa124_data_scaling.py)."""

import os
import random
import subprocess
import sys
from pathlib import Path

WORDS = ["the", "of", "and", "data", "token", "δέλτα", "ωμέγα", "привет", "мир", "日本語", "中文字", "naïve",
         "Ünïcödé", "😀", "def", "return", "x = 1", "42", "1999", "(", ")", ".", ",", "\n"]


THREADS = {"RAYON_NUM_THREADS": "2", "MALLOC_ARENA_MAX": "2"}


def corpus_files(root: Path, mb: float, seed: int = 0) -> Path:
    """~mb MB of UTF-8 text in ~25 KB files: Zipf-weighted words (ASCII, Greek, Cyrillic, CJK, emoji) and
    random syllable words, so the BPE sees both frequent and rare ones."""
    rng = random.Random(seed)
    syllable = lambda: rng.choice("bcdfgklmnprstvz") + rng.choice("aeiou")  # noqa: E731
    vocab = WORDS + ["".join(syllable() for _ in range(rng.randint(1, 4))) for _ in range(5000)]
    weights = [1 / (r + 2.7) for r in range(len(vocab))]
    root.mkdir(parents=True)
    written, i = 0, 0
    while written < mb * 1e6:
        text = " ".join(rng.choices(vocab, weights, k=4000))
        (root / f"doc{i:05d}.txt").write_text(text, encoding="utf-8")
        written += len(text.encode())
        i += 1
    return root


def prepare_peak_rss(work: Path, corpus: Path, tokenizer: str | None) -> dict:
    """`python -m moe_train prepare-data corpus [--tokenizer T] --out work/out-N` in a child process: its peak RSS
    (MB, the child's own rusage), the tokenizer.json it wrote and the folder. Two tokenizer threads and two malloc
    arenas: the peak varies less from run to run (+-8 MB, against +-15 with the default arenas)."""
    out = work / f"out-{len(list(work.glob('out-*')))}"
    args = [sys.executable, "-m", "moe_train", "prepare-data", str(corpus), "--out", str(out)]
    proc = subprocess.Popen(args + (["--tokenizer", tokenizer] if tokenizer else []), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, **THREADS})
    output = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, output
    return {"rss_mb": usage.ru_maxrss / 1024, "tokenizer": str(out / "tokenizer.json"), "out": out}
