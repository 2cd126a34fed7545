"""QA 97: does the model train on the data the README says?

An independent reference read from the bytes on disk (meta.json, little-endian uint32 token files, uint64 document
ends) against what prepare-data wrote and what the real Trainer hands its model (Transformer.loss recorded):
- prepare-data: the files are the documents' tokens, each document ended by one EOS, split into train and eval in
  whole blocks of the size meta.json records, and decode back to the text (unicode, control characters, a long
  word); a tokenizer.json saved with truncation or padding, or with a post-processor that already ends each text
  with EOS, gives the same tokens as the plain tokenizer; ids past uint16 keep their value, and meta.json's
  vocab_size holds every id the tokenizer can emit.
- the Trainer, on one process and on two gloo ranks (grad accumulation making up the global batch of 8): every
  window is train.u32[k*S : k*S+S+1] with targets shifted by one, an epoch visits each window once, each step's
  global batch is the same windows on every layout and no two ranks share one, a resume at step 3 on the other
  layout goes on with the unbroken run's windows, and every eval is the same windows of eval.u32, evenly spread.
"""

from __future__ import annotations

import json
import sys
import warnings
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

sys.path.insert(0, str(Path(__file__).parent))
import qa97_worker as w  # noqa: E402

from moe_train.data import WindowSampler, open_data, prepare_data, stdlib_documents  # noqa: E402

EOS = "<|endoftext|>"
UNICODE = ("naïve café — 東京タワー 🚀🧪 e\u0301 עברית العربية\r\n"
           "\ttab\x00nul\u2028line sep\u00a0nbsp\u3000"
           "\x1c\x1dgroup seps ñ" + "Ω" * 300 + " ok\n")


def documents() -> list[str]:
    """Six beginnings of standard-library files (text that does not repeat), a unicode one, and empty ones."""
    heads = [d[:700] for d in islice(iter(stdlib_documents(10**7)), 6)]
    return heads[:3] + ["", UNICODE, "  \n\t"] + heads[3:]


def kept(docs: list[str]) -> list[str]:
    return [d for d in docs if d.strip()]


def read(folder: Path, name: str, dtype: str = "<u4") -> np.ndarray:
    """A token or document-end file as the README describes it: flat little-endian integers, no header."""
    return np.fromfile(folder / name, dtype=dtype).astype(np.int64)


def meta_of(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qa97")


@pytest.fixture(scope="module")
def data(root) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a small corpus may give fewer BPE tokens than asked for
        return prepare_data(documents(), root / "data", vocab_size=300, eval_fraction=0.25, source="qa97")


def expected_stream(tok: Tokenizer, docs: list[str], eos: int) -> np.ndarray:
    return np.concatenate([np.append(np.asarray(tok.encode(d, add_special_tokens=False).ids, np.int64), eos)
                           for d in kept(docs)])


def test_prepared_files_are_the_documents_tokens_in_whole_blocks_as_meta_json_says(data):
    meta, tok = meta_of(data), Tokenizer.from_file(str(data / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    assert meta["eos_id"] == eos
    stream = expected_stream(tok, documents(), eos)
    splits = {name: read(data, f"{name}.u32") for name in ("train", "eval")}
    for name, tokens in splits.items():
        m = meta["splits"][name]
        assert (data / f"{name}.u32").stat().st_size == 4 * m["num_tokens"] == 4 * tokens.size
        assert m["max_token_id"] == tokens.max() < meta["vocab_size"]
        ends = np.flatnonzero(tokens == eos) + 1
        if ends[-1] != tokens.size:  # a block cut the split's last document
            ends = np.append(ends, tokens.size)
        assert np.array_equal(read(data, f"{name}.docs.u64", "<u8"), ends) and m["num_docs"] == ends.size
    # train and eval are the stream cut in blocks of eval_block_tokens, every 4th (1 / eval_fraction) held out
    block, at, held_out = meta["eval_block_tokens"], {"train": 0, "eval": 0}, []
    for i, start in enumerate(range(0, stream.size, block)):
        chunk = stream[start : start + block]
        name = next((n for n in ("train", "eval") if np.array_equal(splits[n][at[n] : at[n] + chunk.size], chunk)),
                    None)
        assert name is not None, f"block {i} of {block} tokens is in neither split in order"
        at[name] += chunk.size
        held_out += [i] if name == "eval" else []
    assert at == {"train": splits["train"].size, "eval": splits["eval"].size}
    n_blocks = -(-stream.size // block)
    assert n_blocks >= 8 and held_out == list(range(held_out[0], n_blocks, 4)) and held_out[0] < 4
    # the documents come back whole from their tokens, unicode and control characters included
    ids = stream.tolist()
    ends = [i for i, t in enumerate(ids) if t == eos]
    assert [tok.decode(ids[a + 1 if a else 0 : b]) for a, b in zip([0] + ends, ends)] == kept(documents())


@pytest.fixture(scope="module")
def plain(data, root) -> Path:
    """data's documents tokenized again with data's own tokenizer.json (given, not trained)."""
    return prepare_data(documents(), root / "plain", tokenizer_path=str(data / "tokenizer.json"), eval_fraction=0.25)


def token_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ("train.u32", "eval.u32", "train.docs.u64", "eval.docs.u64")}


@pytest.mark.parametrize("how", ["truncation", "padding", "post-processor ends with eos"])
def test_a_tokenizer_json_that_cuts_pads_or_ends_texts_itself_gives_the_plain_tokens(how, data, plain, tmp_path):
    """A tokenizer.json saved with truncation cut every document to max_length, one with padding filled each with
    pad ids, and one whose post-processor ends each text with EOS (T5, BART, RoBERTa: `$A </s>`) ended every
    document twice (an empty document after each), all silently."""
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    if how == "truncation":
        tok.enable_truncation(max_length=16)
    elif how == "padding":
        tok.enable_padding(length=1024, pad_id=5, pad_token=tok.id_to_token(5))
    else:
        tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, eos)])
    tok.save(str(tmp_path / "tok.json"))
    got = prepare_data(documents(), tmp_path / "d", tokenizer_path=str(tmp_path / "tok.json"), eval_fraction=0.25)
    assert token_files(got) == token_files(plain)
    both = np.concatenate([read(got, "train.u32"), read(got, "eval.u32")])
    assert int((both == eos).sum()) == len(kept(documents()))


def test_ids_past_uint16_keep_their_value_and_meta_json_holds_every_id(tmp_path):
    """uint32 on disk: 65535, 65536 and 70000 read back as written. meta.json's vocab_size was get_vocab_size()
    (here 6 tokens), which the model then sized its embedding by: every id past it refused at open."""
    vocab = {"a": 0, "[UNK]": 1, "b": 65535, "c": 65536, "d": 69999, EOS: 70000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS])
    tok.save(str(tmp_path / "tok.json"))
    docs = [" ".join("abcd"[(i * j) % 4] for j in range(40)) + " e" for i in range(30)]
    out = prepare_data(docs, tmp_path / "d", tokenizer_path=str(tmp_path / "tok.json"), eval_fraction=0.5)
    meta = meta_of(out)
    both = np.concatenate([read(out, "train.u32"), read(out, "eval.u32")])
    want = expected_stream(tok, docs, 70000)
    assert sorted(both.tolist()) == sorted(want.tolist()) and set(both.tolist()) == {0, 1, 65535, 65536, 69999, 70000}
    assert meta["vocab_size"] == 70001 and meta["eos_id"] == 70000
    _, splits = open_data(out, meta["vocab_size"])  # the model vocab_size prepare-data prints opens its folder
    tokens = read(out, "train.u32")
    n = (tokens.size - 1) // 8
    x, y = WindowSampler(splits["train"].tokens, 8, seed=0, shuffle=False, vocab_size=70001).next_batch(n)
    assert x.tolist() == [tokens[k * 8 : k * 8 + 8].tolist() for k in range(n)] and int(x.max()) == 70000
    assert y.tolist() == [tokens[k * 8 + 1 : k * 8 + 9].tolist() for k in range(n)]


# ---- the Trainer: what the model is handed ---------------------------------------------------------------------
S = w.SEQ_LEN


@pytest.fixture(scope="module")
def runs(root, data) -> dict[str, list[list[tuple]]]:
    """Each run's forwards per rank, all global batches of 8 windows: dp1 (micro-batches of 4 x 2), dp2 (2 x 2),
    and resumed at step 3: dp1 -> dp2 (1 x 4) and dp2 -> dp1 (2 x 4)."""
    cfg = lambda name, dp, micro: w.run_config(root, data, name, dp, micro)  # noqa: E731
    out = {"one": [w.recorded_run(cfg("one", 1, 4))]}
    w.seed_from(root / "one", root / "two_from_one")
    ranks = w.spawn_dp2([cfg("two", 2, 2), cfg("two_from_one", 2, 1)], root / "spawn")
    out.update({name: [r[name] for r in ranks] for name in ranks[0]})
    w.seed_from(root / "two", root / "one_from_two")
    out["one_from_two"] = [w.recorded_run(cfg("one_from_two", 1, 2))]
    return out


def windows_of(tokens: np.ndarray) -> dict[bytes, int]:
    """The split's windows by their inputs: S + 1 tokens starting every S (sharing an end token with the next)."""
    n = (tokens.size - 1) // S
    index = {tokens[k * S : k * S + S].tobytes(): k for k in range(n)}
    assert len(index) == n  # no two windows alike in this corpus, so a window's inputs name it
    return index


def window(tokens: np.ndarray, index: dict[bytes, int], x: np.ndarray, y: np.ndarray) -> int:
    k = index.get(x.astype(np.int64).tobytes())
    assert k is not None, "the model was handed inputs that are not a window of the split"
    assert np.array_equal(y, tokens[k * S + 1 : k * S + S + 1]), f"window {k}: targets not its inputs shifted by one"
    return k


def steps_of(run: list[list[tuple]], tokens: np.ndarray) -> list[list[list[int]]]:
    """[step][rank] -> the train windows that rank's micro-batches were handed in that step."""
    index = windows_of(tokens)
    per_rank = [[window(tokens, index, x_row, y_row) for training, x, y in forwards if training
                 for x_row, y_row in zip(x, y)] for forwards in run]
    rows = w.GLOBAL_BATCH // len(run)
    assert all(len(p) % rows == 0 for p in per_rank)
    return [[p[s * rows : (s + 1) * rows] for p in per_rank] for s in range(len(per_rank[0]) // rows)]


def test_every_train_window_is_a_slice_of_train_u32_and_an_epoch_visits_each_once(runs, data):
    tokens = read(data, "train.u32")
    n = (tokens.size - 1) // S
    drawn = [k for step in steps_of(runs["one"], tokens) for k in step[0]]  # one rank: in the global order
    assert len(drawn) == w.STEPS * w.GLOBAL_BATCH and w.GLOBAL_BATCH < n < len(drawn)  # the epoch turns over
    epochs = [drawn[e : e + n] for e in range(0, len(drawn), n)]
    for epoch in epochs:  # each a permutation of all windows, the last one (at the file's end) included
        assert sorted(epoch) == list(range(n)) if len(epoch) == n else len(set(epoch)) == len(epoch)
    assert epochs[1] != epochs[0][: len(epochs[1])]  # reshuffled


def test_each_steps_global_batch_is_the_same_windows_on_any_layout_and_resume(runs, data):
    tokens = read(data, "train.u32")
    n = (tokens.size - 1) // S
    want = [sorted(k for rank in step for k in rank) for step in steps_of(runs["one"], tokens)]
    assert len(want) == w.STEPS
    for name in ("two", "two_from_one", "one_from_two"):
        steps = steps_of(runs[name], tokens)
        got = [sorted(k for rank in step for k in rank) for step in steps]
        first = w.STEPS - len(got)  # a resumed run trains steps 4..6 only
        assert first == (w.SAVE_AT if "from" in name else 0) and got == want[first:], name
        for s, step in enumerate(steps, start=first):
            if (s + 1) * w.GLOBAL_BATCH <= n and len(step) == 2:  # inside epoch 0: no window twice in a step
                assert not set(step[0]) & set(step[1]), (name, s + 1)


def test_every_eval_is_the_same_evenly_spread_windows_of_eval_u32_on_every_layout(runs, data):
    tokens, train = read(data, "eval.u32"), windows_of(read(data, "train.u32"))
    index, n = windows_of(tokens), (tokens.size - 1) // S
    want = None
    for name, run in runs.items():
        evals_per_rank = []
        for forwards in run:
            groups, last = [], True
            for training, x, y in forwards:
                if not training:
                    groups += [[]] if last else []
                    groups[-1] += [window(tokens, index, xr, yr) for xr, yr in zip(x, y)]
                    assert all(xr.astype(np.int64).tobytes() not in train for xr in x)
                last = training
            evals_per_rank.append(groups)
        evals = [sorted(k for rank in ranks for k in rank) for ranks in zip(*evals_per_rank)]
        assert len(evals) == (1 if "from" in name else 3), name  # at 0, 3, 6; resumed: at 6
        for ks in evals:
            want = ks if want is None else want
            assert ks == want, name
    gaps = np.diff(want)
    assert n > w.EVAL_WINDOWS == len(want) == len(set(want))
    assert gaps.max() - gaps.min() <= 1 and want[-1] - want[0] >= n - 1 - gaps.max()  # spread over the whole split


@pytest.mark.parametrize("fraction", [0.3, 0.7, 0.15, 0.6, 0.04])
def test_the_held_out_share_is_the_eval_fraction_asked_for_spread_evenly(fraction, tmp_path):
    """eval_fraction = 0.3 held out every round(1/0.3) = 3rd block (a third), 0.7 and 0.6 every 2nd (a half), 0.15
    every 7th: the corpus was split otherwise than asked, without a word. Now the share is the one asked for, to a
    block, with no two held-out blocks bunched closer than the share allows; 1/n keeps its every n-th block."""
    from moe_train.data.prepare import eval_blocks

    block, is_eval = eval_blocks(1000 * 2048, fraction, 2048)
    assert block == 2048 and abs(is_eval.sum() - fraction * is_eval.size) <= 1
    held, kept = np.flatnonzero(is_eval), np.flatnonzero(~is_eval)
    for idx, share in ((held, fraction), (kept, 1 - fraction)):  # evenly spread: gaps within one block of 1/share
        gaps = np.diff(idx)
        assert gaps.min() >= np.floor(1 / share) and gaps.max() <= np.ceil(1 / share), (share, gaps.min(), gaps.max())
    _, every_tenth = eval_blocks(1000 * 2048, 0.1, 2048)
    assert np.flatnonzero(every_tenth)[:3].tolist() == [5, 15, 25]  # 1/n as before: block n//2, then every n-th
    docs = [f"document {i} " + "word " * 200 for i in range(60)]
    meta = json.loads((prepare_data(docs, tmp_path / "d", vocab_size=300, eval_fraction=fraction) / "meta.json")
                      .read_text())
    tokens = {name: meta["splits"][name]["num_tokens"] for name in ("train", "eval")}
    held_share = tokens["eval"] / (tokens["eval"] + tokens["train"])
    assert abs(held_share - fraction) <= 1.5 * meta["eval_block_tokens"] / (tokens["eval"] + tokens["train"]), held_share
