"""QA of the drawn-window token id checks (moe-train 0.16.0): under data parallelism a bad window drawn by one rank
stops every rank with the data error (not one rank with it and the others with a collective's failure, or a wait
for the collective timeout); and a recorded max_token_id no split of that size can have is not trusted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import qa67_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402

from moe_train.data import DataError, WindowSampler, open_data  # noqa: E402


def test_every_rank_refuses_a_global_batch_whose_bad_window_another_rank_draws(data_dir):
    at = w.poison_rank1s_first_window(data_dir)
    _, splits = open_data(data_dir, 512)
    errors = []
    for rank in (0, 1):
        sampler = WindowSampler(splits["train"].tokens, w.SEQ_LEN, seed=0, vocab_size=512)
        with pytest.raises(DataError, match=rf"train.u32 at token {at}: token id 600 >= vocab_size=512") as e:
            sampler.next_batch(2, rank=rank, world=2)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_one_ranks_bad_window_stops_both_dp_ranks_with_the_data_error(tmp_path, data_dir):
    at = w.poison_rank1s_first_window(data_dir)
    root = tmp_path / "ranks"
    root.mkdir()
    h.start_ranks(h.run_guarded, args=(w.train_dp2, str(root), h.free_port(), str(root), str(data_dir)), nprocs=2)
    results = h.load_results(root, 2)
    for rank, res in enumerate(results):
        assert res["type"] == "DataError", f"rank {rank} stopped with {res['type']}: {res['message']}"
        assert f"train.u32 at token {at}: " in res["message"], rank
    events = [r for r in map(json.loads, (root / "run" / "metrics.jsonl").read_text().splitlines()) if "event" in r]
    assert events[-1]["status"] == "failed" and events[-1]["error"].startswith("DataError: "), events[-1]


def set_recorded(data_dir: Path, name: str, value: object) -> None:
    meta = json.loads((data_dir / "meta.json").read_text())
    meta["splits"][name]["max_token_id"] = value
    (data_dir / "meta.json").write_text(json.dumps(meta))


def test_a_recorded_largest_id_of_minus_one_on_a_split_with_tokens_is_not_trusted(data_dir):
    tokens = np.fromfile(data_dir / "train.u32", dtype="<u4")
    tokens[-1] = 600  # past the last full window: only a scan at open finds it
    tokens.tofile(data_dir / "train.u32")
    set_recorded(data_dir, "train", -1)  # "no tokens", for a split that has them
    with pytest.raises(DataError, match=r"train.u32: token id 600 >= model.vocab_size=512"):
        open_data(data_dir, 512)


def test_a_recorded_largest_id_no_uint32_token_can_have_is_not_trusted(data_dir):
    set_recorded(data_dir, "eval", 2**40)
    meta, splits = open_data(data_dir, 512)  # scanned: every id is below 512
    assert splits["eval"].tokens.size == meta["splits"]["eval"]["num_tokens"]
