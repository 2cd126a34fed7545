"""Opening a data folder against the model's config, and the window sampler's contract (module docstring of
moe_train.data.sampler): one global stream of windows, ranks take interleaved shares, one integer resumes it."""

import json
import shutil

import numpy as np
import pytest

from moe_train.cli import main
from moe_train.config import DataConfig
from moe_train.data import DataError, WindowSampler, eval_windows, open_data, prepare_data
from moe_train.trainer.data_setup import default_data_dir


def max_token(folder) -> int:
    return max(int(np.fromfile(folder / f"{s}.u32", dtype="<u4").max()) for s in ("train", "eval"))


def test_a_data_folder_tokenized_with_a_larger_vocab_than_the_model_is_refused(data_dir, tmp_path, capsys):
    """Ids that happen to fit used to pass: a model that cannot embed what its tokenizer.json emits."""
    data = prepare_data(["hello world\n"] * 50, tmp_path / "d", tokenizer_path=str(data_dir / "tokenizer.json"))
    v = max_token(data) + 1
    assert v < 512  # this text uses only the low ids of the fixture's 512-token vocabulary
    with pytest.raises(DataError, match=rf"tokenized with vocab_size=512, larger than model.vocab_size={v}"):
        open_data(data, v)
    open_data(data, 512)
    open_data(data, 600)  # a larger (padded) model vocabulary is fine
    assert main(["train", f"--data.path={data}", f"--model.vocab_size={v}", f"--train.run_dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    assert f"model.vocab_size={v}" in err and "--vocab-size" in err and not (tmp_path / "r").exists()


def test_token_count_mismatch_names_the_file_and_both_counts(data_dir, tmp_path):
    data = shutil.copytree(data_dir, tmp_path / "copy")
    meta = json.loads((data / "meta.json").read_text())
    n = meta["splits"]["eval"]["num_tokens"]
    (data / "eval.u32").write_bytes((data / "eval.u32").read_bytes()[:-8])
    with pytest.raises(DataError, match=rf"eval.u32: holds {n - 2} tokens .* but meta.json says {n}"):
        open_data(data, 512)


def test_loading_a_state_of_another_seed_after_sampling_gives_that_seeds_windows():
    """The permutation drawn before load_state_dict was kept: windows of the old seed under the new one."""
    tokens = np.arange(1001, dtype=np.uint32)
    s = WindowSampler(tokens, 10, seed=0)
    s.next_batch(2)
    want = WindowSampler(tokens, 10, seed=1)
    s.load_state_dict(want.state_dict())
    for _ in range(3):
        assert all(np.array_equal(a, b) for a, b in zip(s.next_batch(4), want.next_batch(4)))


def global_batches(world: int, micro: int, accum: int, steps: int, resume_at: int | None = None,
                   world_after: int | None = None) -> list[list[tuple[int, ...]]]:
    """Each step's windows over all ranks (a set, as sorted rows), the way the Trainer draws them; at resume_at
    the state goes through JSON into fresh samplers, on world_after ranks with the same global batch."""
    tokens = np.arange(1001, dtype=np.uint32)  # 100 windows of 10+1: epochs turn over inside steps below
    ranks = [WindowSampler(tokens, 10, seed=7) for _ in range(world)]
    steps_seen = []
    for step in range(steps):
        if step == resume_at:
            state = json.loads(json.dumps(ranks[0].state_dict()))
            micro, world = micro * world // world_after, world_after
            ranks = [WindowSampler(tokens, 10, seed=7) for _ in range(world)]
            for r in ranks:
                r.load_state_dict(state)
        rows = [tuple(x.tolist()) for _ in range(accum)
                for r, s in enumerate(ranks) for x in s.next_batch(micro, r, world)[0]]
        steps_seen.append(sorted(rows))
    return steps_seen


def test_the_global_batch_stream_is_the_same_for_any_dp_size_and_resume_point():
    whole = global_batches(1, 12, 2, 12)
    assert global_batches(2, 6, 2, 12) == whole
    assert global_batches(4, 3, 2, 12) == whole
    assert global_batches(1, 12, 2, 12, resume_at=5, world_after=1) == whole  # resume mid-epoch (step 5 of 100/24)
    assert global_batches(2, 6, 2, 12, resume_at=3, world_after=4) == whole  # and on another layout
    first_four = [w for step in whole[:4] for w in step]  # 96 of the first epoch's 100 windows
    assert len(set(first_four)) == 96


def test_a_stream_of_exactly_one_window_and_one_token_short():
    tokens = np.arange(11, dtype=np.uint32)  # seq_len + 1 tokens: exactly one window
    s = WindowSampler(tokens, 10, seed=0)
    x, y = s.next_batch(3)
    assert s.num_windows == 1 and torch_rows(x) == [list(range(10))] * 3 and torch_rows(y) == [list(range(1, 11))] * 3
    assert [torch_rows(x) for x, _ in eval_windows(tokens, 10, 5, 4)] == [[list(range(10))]]
    with pytest.raises(DataError, match=r"has 10 tokens, fewer than one window of data.seq_len\+1=11"):
        WindowSampler(tokens[:10], 10, seed=0)
    assert eval_windows(tokens[:10], 10, 5, 4) == []


def torch_rows(t) -> list[list[int]]:
    return t.tolist()


def test_eval_windows_beyond_what_the_split_holds_are_all_of_them_once():
    tokens = np.arange(1001, dtype=np.uint32)
    got = eval_windows(tokens, 10, 10_000, 7)
    starts = [row[0] for x, _ in got for row in x.tolist()]
    assert starts == list(range(0, 1000, 10))


def test_the_default_data_folder_is_named_by_everything_that_shapes_it():
    """data.eval_fraction changes the split but was not in the cached folder's name: a changed value reused the
    folder prepared with the old one. The default fraction keeps the old name (folders already made stay)."""
    base = DataConfig()
    assert default_data_dir(base) == default_data_dir(DataConfig(eval_fraction=0.02))
    assert default_data_dir(DataConfig(eval_fraction=0.1)) != default_data_dir(base)
    assert default_data_dir(DataConfig(eval_fraction=0.1)).name.endswith("-e0.1")
