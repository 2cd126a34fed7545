"""QA 117 review of 0.21.5 (config warnings shown by rank 0 alone under torchrun) and of moe-ckpt 0.19.0 (metadata.json
checksummed) as moe-train reads it.

Found: a RANK that is no integer ('x', '') in a single-process run (no WORLD_SIZE) refused train and bench before
anything else (`RANK='x' in the environment`): that run never reads RANK (make_runtime reads it only for a process
group), and it ran on 0.21.4. And a single process with RANK=1 left in its environment (no WORLD_SIZE) hid the
config's warnings: it is the only process, no rank 0 shows them."""

from __future__ import annotations

import pytest

from moe_train.cli import main

WARNING = "moe-train: warning: model.router.top_k=4: no effect with model.num_experts=0"


@pytest.mark.parametrize("command", ["train", "bench"])
@pytest.mark.parametrize("rank", ["x", "", "1"])
def test_a_single_process_shows_config_warnings_and_is_not_refused_whatever_rank_the_environment_names(
        capsys, monkeypatch, tmp_path, command, rank):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", rank)
    (tmp_path / "c.yaml").write_text("model:\n  num_experts: 0\n  router:\n    top_k: 4\n")
    # parallel.dp=3 stops the run at make_runtime's layout check, past the config build, before any process group
    extra = [f"--train.run_dir={tmp_path / 'run'}"] if command == "train" else []
    assert main([command, "--config", str(tmp_path / "c.yaml"), "--parallel.dp=3", "--train.device=cpu",
                 *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("moe-train: warning:")][0].startswith(WARNING), err
    assert err[-1].startswith("moe-train: error: parallel layout: parallel.dp=3"), err


@pytest.mark.parametrize("rank", ["0", "1"])
def test_bench_under_torchrun_shows_config_warnings_on_rank_0_alone_and_its_errors_on_every_rank(
        capsys, monkeypatch, tmp_path, rank):
    """Held (0.21.5): as train (test_qa115_rank_warnings), for bench."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    (tmp_path / "c.yaml").write_text("model:\n  num_experts: 0\n  router:\n    top_k: 4\n")
    assert main(["bench", "--config", str(tmp_path / "c.yaml"), "--parallel.dp=3", "--train.device=cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith(WARNING)]) == (rank == "0"), err
    assert err[-1].startswith("moe-train: error: parallel layout: parallel.dp=3"), err


def test_a_resume_from_an_edited_metadata_json_is_one_error_line_naming_the_file_and_the_way_back(
        capsys, tmp_path, data_dir, make_config):
    """Held (moe-ckpt 0.19.0): `moe-train train` on a run whose newest metadata.json was edited (still valid JSON)
    exits 2 with one line that names the file, says it changed since the save, and names the older checkpoint to
    resume from and the move that does it; inspect and export-hf refuse it too, naming the file."""
    import yaml

    d = make_config(tmp_path, steps=2, save_interval=1, eval_interval=0, grad_accum=1, device="cpu").to_dict()
    d.pop("preset")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 0
    meta = tmp_path / "run" / "checkpoints" / "step-00000002" / "metadata.json"
    meta.write_bytes(meta.read_bytes().replace(b'"samples_seen": ', b'"samples_seen": 1', 1))
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--train.steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moe-train: error: metadata file {meta} has "), err
    assert "edited or corrupt since the save" in err[0] and "step-00000001 (step 1" in err[0], err
    assert f"mv {meta.parent} {meta.parent}.damaged" in err[0], err
    for command in (["inspect", str(tmp_path / "run")], ["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]):
        assert main(command) == 2
        assert capsys.readouterr().err.startswith(f"moe-train: error: metadata file {meta} has "), command
    assert not (tmp_path / "hf").exists()
