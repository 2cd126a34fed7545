"""prepare-data streams: documents are read a file at a time and tokenized a batch at a time, the token stream
goes through a file, so memory is bounded by a batch, not the corpus; and the output is the one the in-memory
reference (whole corpus encoded at once, split by `split_blocks`) gives, byte for byte."""

import hashlib
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from moe_train.cli import main
from moe_train.data import Documents, prepare_data, text_file_documents, train_bpe
from moe_train.data import prepare as prepare_mod
from moe_train.data.prepare import EOS, EVAL_BLOCK_TOKENS, eval_blocks

FILES = ["eval.docs.u64", "eval.u32", "meta.json", "tokenizer.json", "train.docs.u64", "train.u32"]


def split_blocks(stream: np.ndarray, eval_fraction: float, block: int) -> tuple[np.ndarray, np.ndarray]:
    """stream: [N] uint32 -> (train, eval), in memory, as prepare_data split before it streamed."""
    block, is_eval = eval_blocks(stream.size, eval_fraction, block)
    mask = np.repeat(is_eval, block)[: stream.size]
    return stream[~mask], stream[mask]


def reference_splits(docs: list[str], tokenizer_json: str, eval_fraction: float) -> dict[str, bytes]:
    """What prepare_data wrote when it held the whole corpus in memory: the files' bytes, and the corpus hash."""
    docs = [d for d in docs if d.strip()]
    tok = Tokenizer.from_file(tokenizer_json)
    tok.encode_special_tokens = True
    eos = tok.token_to_id(EOS)
    stream = np.concatenate([a for e in tok.encode_batch_fast(docs) for a in (np.asarray(e.ids, np.uint32), [eos])])
    files = {"corpus_sha256_16": hashlib.sha256("\x00".join(docs).encode()).hexdigest()[:16].encode()}
    for name, tokens in zip(("train", "eval"), split_blocks(stream.astype(np.uint32), eval_fraction,
                                                            EVAL_BLOCK_TOKENS)):
        ends = (np.flatnonzero(tokens == eos) + 1).tolist()
        if tokens.size and (not ends or ends[-1] != tokens.size):
            ends.append(tokens.size)
        files[f"{name}.u32"] = tokens.astype("<u4").tobytes()
        files[f"{name}.docs.u64"] = np.asarray(ends, dtype="<u8").tobytes()
    return files


def written(folder) -> dict[str, bytes]:
    files = {name: (folder / name).read_bytes() for name in FILES if name.endswith(("u32", "u64"))}
    files["corpus_sha256_16"] = json.loads((folder / "meta.json").read_text())["corpus_sha256_16"].encode()
    return files


def corpus(n_docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["def", "return", "alpha", "δέλτα", "日本", EOS, "\n", "    ", "x = 1\n"]
    docs = [" ".join(rng.choices(words, k=rng.randint(1, 400))) for _ in range(n_docs)]
    return [d if i % 9 else " \n\t" for i, d in enumerate(docs)]  # whitespace-only documents mixed in


# A tiny corpus (its blocks shrink to fit), and one of many full 2048-token blocks
@pytest.mark.parametrize("n_docs,eval_fraction", [(6, 0.02), (400, 0.25)])
def test_streamed_prepare_matches_the_in_memory_reference_byte_for_byte(n_docs, eval_fraction, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr(prepare_mod, "ENCODE_BATCH_CHARS", 5_000)  # many batches and chunks, blocks cut by them
    monkeypatch.setattr(prepare_mod, "SPLIT_CHUNK_TOKENS", 3_001)
    docs = corpus(n_docs, seed=n_docs)
    trained = prepare_data(docs, tmp_path / "trained", vocab_size=320, eval_fraction=eval_fraction)
    train_bpe([d for d in docs if d.strip()], 320).save(str(tmp_path / "tok.json"))
    assert (trained / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    given = prepare_data(Documents(lambda: iter(docs)), tmp_path / "given", tokenizer_path=str(tmp_path / "tok.json"),
                         eval_fraction=eval_fraction)
    expected = reference_splits(docs, str(tmp_path / "tok.json"), eval_fraction)
    for folder in (trained, given):
        assert sorted(p.name for p in folder.iterdir()) == FILES  # the token stream's file is gone
        assert written(folder) == expected
    if n_docs > 100:
        assert len(expected["eval.docs.u64"]) // 8 > 10  # eval spans many blocks, not a shrunken few


def test_a_file_found_not_utf8_late_in_the_stream_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    """With streaming, a bad file is read after others were tokenized (and, training a BPE, after a whole pass):
    the temporary folder goes and the earlier data folder at --out stays as it was."""
    monkeypatch.setattr(prepare_mod, "ENCODE_BATCH_CHARS", 1_000)
    src = tmp_path / "in"
    src.mkdir()
    for i, doc in enumerate(corpus(60, seed=1)):
        (src / f"a{i:02d}.txt").write_text(doc)
    out = prepare_data(text_file_documents([str(src)]), tmp_path / "d", vocab_size=300)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (src / "zz.txt").write_bytes(b"caf\xe9 au lait\n")  # read last: sorted
    for extra in (["--vocab-size", "300"], ["--tokenizer", str(out / "tokenizer.json")]):
        assert main(["prepare-data", str(src), "--out", str(out), *extra]) == 2
        assert f"{str(src / 'zz.txt')!r} is not UTF-8 text (byte 0xe9 at offset 3)" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "in"]
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_text_file_documents_reads_the_files_on_each_pass_not_when_made(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    docs = text_file_documents([str(tmp_path)])
    (tmp_path / "a.txt").write_text("second")
    assert list(docs) == ["second"] and list(docs) == ["second"]
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a missing input is found at once
        text_file_documents([str(tmp_path / "missing")])


def test_training_a_bpe_refuses_a_one_shot_iterator_and_a_given_tokenizer_takes_one(tmp_path):
    docs = corpus(40, seed=2)
    with pytest.raises(TypeError, match=r"one-shot iterator \(generator\).* reads the documents twice"):
        prepare_data((d for d in docs), tmp_path / "a", vocab_size=300)
    assert not (tmp_path / "a").exists()
    first = prepare_data(docs, tmp_path / "b", vocab_size=300)
    again = prepare_data((d for d in docs), tmp_path / "c", tokenizer_path=str(first / "tokenizer.json"))
    assert written(again) == written(first)


# The child's own high-water mark (VmHWM), not getrusage's maxrss: that one keeps the parent's, across exec.
PEAK_RSS = """
import json, re, sys
import moe_train.data  # numpy, tokenizers and torch: loaded before the baseline
from moe_train.cli import main
def status(key): return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
base = status("VmRSS")
assert main(["prepare-data", *sys.argv[1:]]) == 0
print(json.dumps({"base": base, "peak": status("VmHWM")}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_prepare_memory_is_bounded_by_a_batch_not_by_the_corpus(tmp_path):
    """48 MB of text in 2,500 files: the process grows by a batch (32-38 MB measured, the same at 144 MB of text:
    a batch of documents, their encodings, a chunk of the split), held under 64 MB. Holding the corpus (documents,
    their encodings, the stream and its splits) grew it by 18x the text (2.6 GB at 144 MB), ~860 MB here."""
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(300)]
    text = " ".join(rng.choices(words, k=3_000)) + "\n"  # ~20 KB
    train_bpe([text * 10], 1500).save(str(tmp_path / "tok.json"))  # whole words: ~7 characters a token
    (tmp_path / "in").mkdir()
    for i in range(2_500):
        (tmp_path / "in" / f"{i:04d}.txt").write_text(f"{i} {text[i % 1000:]}")
    corpus_bytes = sum(p.stat().st_size for p in (tmp_path / "in").iterdir())
    # two tokenizer threads, as on a small machine: each holds a document's transient work
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, str(tmp_path / "in"), "--out", str(tmp_path / "d"),
                           "--tokenizer", str(tmp_path / "tok.json")], capture_output=True, text=True,
                          env={**os.environ, "RAYON_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = rss["peak"] - rss["base"]
    assert growth < 64 * 2**20, f"peak RSS grew {growth / 2**20:.0f} MB on {corpus_bytes / 2**20:.0f} MB of text"
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert sum(s["num_docs"] for s in meta["splits"].values()) >= 2_500
