"""QA 43: inputs the other tests never tried."""

import json
import os
import re
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig
from moe_train.hf_bridge import export_hf
from moe_train.model import Transformer
from moe_train.trainer.data_setup import default_data_dir
from moe_train.trainer.errors import TrainingError
from moe_train.trainer.loop import Trainer


def test_export_of_a_run_on_the_embedded_corpus_with_its_own_eval_fraction_ships_that_runs_tokenizer(tmp_path):
    """The embedded corpus's cache folder is named by data.eval_fraction too; export looked in the folder of the
    default fraction, found none and shipped no tokenizer."""
    cfg = Config(
        model=ModelConfig(vocab_size=300, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, dense_hidden=16,
                          num_experts=2, expert_hidden=8, router=RouterConfig(top_k=1, normalize_top_k=False)),
        data=DataConfig(seq_len=16, cache_dir=str(tmp_path / "cache"), default_vocab_size=300,
                        default_max_bytes=30_000, eval_fraction=0.1),
        train=TrainConfig(steps=1, micro_batch_size=2, warmup_steps=0, eval_interval=0, save_interval=1,
                          run_dir=str(tmp_path / "run"), progress=False),
        preset="test",
    )
    Trainer(cfg).train()
    folder = default_data_dir(cfg.data)
    assert folder.name.endswith("-e0.1") and (folder / "tokenizer.json").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "no tokenizer found" is a warning
        export_hf(tmp_path / "run", tmp_path / "hf", dtype="fp32")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_a_model_vocabulary_below_the_embedded_corpus_bpe_is_refused_before_tokenizing(tmp_path, capsys):
    """It used to tokenize the standard library first, then fail naming a token id and model.vocab_size only."""
    from moe_train.cli import main

    cache = tmp_path / "cache"
    assert main(["train", "--model.vocab_size=1024", f"--data.cache_dir={cache}", f"--train.run_dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    assert "data.default_vocab_size=2048: expected <= model.vocab_size=1024" in err
    assert not cache.exists() and not (tmp_path / "r").exists()


def test_weights_an_update_made_non_finite_are_never_saved_and_the_last_good_checkpoint_stays(data_dir, tmp_path,
                                                                                            make_config):
    """Weights an update turned NaN/Inf (it took lr=1e39, finite as a config value but inf in float32): every later
    step was skipped, yet each save wrote that state (a checkpoint resume refuses) and retention deleted the good
    ones; a run shorter than train.max_skipped_steps even ended "completed"."""
    Trainer(make_config(tmp_path, steps=2, eval_interval=0, save_interval=2, keep_last=1)).train()
    good = tmp_path / "run" / "checkpoints" / "step-00000002"
    trainer = Trainer(make_config(tmp_path, steps=6, eval_interval=0, save_interval=2, keep_last=1))
    step = trainer._train_step

    def overflowing_update():
        out = step()
        if trainer.step == 2:  # the update of step 3
            with torch.no_grad():
                trainer.model.blocks[0].attn.q_proj.weight.view(-1)[0] = float("inf")
        return out

    trainer._train_step = overflowing_update
    named = r"not saving step-00000004: tensor 'blocks.0.attn.q_proj.weight' \(rank 0\) holds NaN or Inf"
    with pytest.raises(TrainingError, match=named):
        trainer.train()
    assert sorted(p.name for p in good.parent.iterdir()) == ["latest", "step-00000002"]
    Trainer(make_config(tmp_path, steps=3, eval_interval=0, save_interval=0)).train()  # it still resumes


@pytest.mark.parametrize("override,message", [
    ("train.lr", "train.lr=1e+39: expected <= 3.403e+38 (float32's largest"),
    ("train.eps", "train.eps=1e-50: expected >= 1.175e-38 (float32's smallest normal number"),
])
def test_an_lr_or_eps_float32_cannot_hold_is_refused_before_the_run(override, message):
    """Both passed as finite numbers > 0, then AdamW's first float32 update made the weights NaN."""
    from moe_train.config import ConfigError
    from moe_train.config_io import build_config

    value = "1e39" if override == "train.lr" else "1e-50"
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config("tiny", overrides={override: value})


def test_export_hf_with_a_tokenizer_file_that_is_no_tokenizer_exits_2_and_writes_nothing(tmp_path, capsys):
    """A text file was a JSONDecodeError traceback after the weights were converted; a JSON file that is no tokenizer
    (the data folder's meta.json, say) was shipped as the export's tokenizer.json."""
    from moe_train.cli import main
    from moe_train.config import validate

    cfg = validate(Config(model=ModelConfig(vocab_size=300, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                            dense_hidden=16, num_experts=2, expert_hidden=8,
                                            router=RouterConfig(top_k=1))))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in Transformer(cfg.model).state_dict().items()}
    save_file(state, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "notes.txt").write_text("not json\n")
    (tmp_path / "meta.json").write_text('{"format": "moe-train-tokens/1", "vocab_size": 300}\n')
    for i, tok in enumerate(("notes.txt", "meta.json")):
        out = tmp_path / f"hf{i}"
        assert main(["export-hf", str(ckpt), str(out), "--tokenizer", str(tmp_path / tok)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"--tokenizer {str(tmp_path / tok)!r}: not a Hugging Face tokenizer.json" in err[0]
        assert not out.exists()


def test_a_one_process_distributed_runtime_does_not_need_port_29500(data_dir, tmp_path, make_config, monkeypatch):
    """A world of 1 without torchrun (bf16 resident weights, a capacity factor, FSDP) listened on 29500: a second
    such run on the machine (one bench per GPU, say) failed with EADDRINUSE."""
    import socket

    import torch.distributed as dist

    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    other = socket.socket()
    try:
        other.bind(("127.0.0.1", 29500))  # another run's rendezvous
        other.listen()
    except OSError:
        pass  # something holds it already: the same situation
    try:
        cfg = make_config(tmp_path, steps=1, grad_accum=1, eval_interval=0, save_interval=0)
        cfg.parallel.expert_capacity_factor = 2.0
        assert Trainer(cfg).train()["step"] == 1
    finally:
        other.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_folder_named_metrics_jsonl_in_the_run_folder_is_refused_naming_it(tmp_path):
    """The run log is a file there; a folder of that name gave an IsADirectoryError traceback."""
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    cfg = Config(
        model=ModelConfig(vocab_size=300, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, dense_hidden=16,
                          num_experts=2, expert_hidden=8, router=RouterConfig(top_k=1)),
        data=DataConfig(seq_len=16, cache_dir=str(tmp_path / "cache"), default_vocab_size=300,
                        default_max_bytes=30_000),
        train=TrainConfig(steps=1, micro_batch_size=2, warmup_steps=0, eval_interval=0, run_dir=str(tmp_path / "run"),
                          progress=False),
        preset="test",
    )
    from moe_train.config import ConfigError

    with pytest.raises(ConfigError, match="holds a folder named metrics.jsonl: expected the run's log file there"):
        Trainer(cfg)
