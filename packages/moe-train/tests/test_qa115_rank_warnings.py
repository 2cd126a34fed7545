"""Under torchrun every process builds the same config: its warnings (here a dense model given router fields) are
shown by rank 0 alone, not once per rank. Each rank is driven through main() with torchrun's environment up to a
layout refusal, which every rank still prints, before any process group exists."""

from __future__ import annotations

import pytest

from moe_train.cli import main

WARNING = "moe-train: warning: model.router.top_k=4: no effect with model.num_experts=0"


def stderr_of_rank(capsys, monkeypatch, tmp_path, rank: int) -> list[str]:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    (tmp_path / "c.yaml").write_text("model:\n  num_experts: 0\n  router:\n    top_k: 4\n")
    code = main(["train", "--config", str(tmp_path / "c.yaml"), "--parallel.dp=3", "--train.device=cpu",
                 f"--train.run_dir={tmp_path / 'run'}"])
    assert code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("rank", [0, 1])
def test_config_warnings_show_on_rank_0_only_and_errors_on_every_rank(capsys, monkeypatch, tmp_path, rank):
    err = stderr_of_rank(capsys, monkeypatch, tmp_path, rank)
    warned = [line for line in err if line.startswith("moe-train: warning:")]
    assert len(warned) == (1 if rank == 0 else 0), err
    assert not warned or warned[0].startswith(WARNING), warned
    assert err[-1].startswith("moe-train: error: parallel layout: parallel.dp=3"), err
    assert not (tmp_path / "run").exists()


def test_info_shows_the_warning_whatever_rank_the_environment_names(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    (tmp_path / "c.yaml").write_text("model:\n  num_experts: 0\n  router:\n    top_k: 4\n")
    assert main(["info", "--config", str(tmp_path / "c.yaml")]) == 0
    assert capsys.readouterr().err.strip().startswith(WARNING)
