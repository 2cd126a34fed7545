import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from ckpt_cases import bits_equal, make_state, shards_for, start_forked

from moe_ckpt import (
    IncompleteCheckpointError,
    ShardSpec,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    load_metadata,
    save_checkpoint,
    step_dir,
)

MIB = {"write": 256, "commit": 16}  # "write" must be big enough to be caught mid-write


def _saver(target: Path, big: torch.Tensor, mode: str) -> None:
    """Child process: save `big`; in mode "commit", block just before rank 0 commits."""
    calls = 0

    def barrier() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # every shard written and fsynced; index.json not yet
            Path(f"{target}.ready").touch()
            time.sleep(600)

    world, bar = (2, barrier) if mode == "commit" else (1, None)
    save_checkpoint(target, [ShardSpec("big", tuple(big.shape), big)], {"step": 2}, 0, world, bar)


def _wait_for(cond, proc, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if not proc.is_alive():
            pytest.fail(f"saver exited with {proc.exitcode} before the kill point")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("saver never reached the kill point")
        time.sleep(0.0005)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("mode", ["write", "commit"])
def test_sigkill_mid_save_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path, mode):
    state = make_state()
    save_checkpoint(step_dir(tmp_path, 1), shards_for(state, 0, 1), {"step": 1})
    target = step_dir(tmp_path, 2)
    tmp = target.with_name(target.name + ".tmp")
    shard = tmp / f"shard-00000-of-0000{2 if mode == 'commit' else 1}.safetensors"
    big = torch.ones(MIB[mode] << 18)  # MIB[mode] MiB of fp32, inherited by the forked child
    # fork: the child starts at once (no second torch import) and dies by SIGKILL, like a lost node
    proc = multiprocessing.get_context("fork").Process(target=_saver, args=(target, big, mode))
    start_forked(proc)
    if mode == "write":  # kill as soon as the shard file has bytes in it
        _wait_for(lambda: shard.exists() and shard.stat().st_size > 0, proc)
    else:  # kill while rank 0 waits to commit: every byte written, nothing committed
        _wait_for(lambda: Path(f"{target}.ready").exists(), proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    assert tmp.is_dir() and not target.exists(), "the kill must land before the commit"
    if mode == "write":
        assert shard.stat().st_size < MIB[mode] << 20, "the kill must land mid-write; make the save bigger"

    assert find_latest(tmp_path) == step_dir(tmp_path, 1)
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)]
    got = load_checkpoint(tmp_path)  # the run directory resolves to step 1
    assert all(bits_equal(got[n], t) for n, t in state.items())
    assert load_metadata(tmp_path)["step"] == 1
    with pytest.raises(IncompleteCheckpointError):
        load_checkpoint(tmp)

    # the run continues: saving step 2 again replaces the leftover and moves `latest`
    save_checkpoint(target, shards_for(state, 0, 1), {"step": 2})
    assert find_latest(tmp_path) == target and not tmp.exists()
