"""QA 128's effect checks of the data and train fields (data.*, train.*): registered with qa128_effects.effect."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from moe_train.config import ConfigError, DataConfig
from moe_train.config_io import build_config
from moe_train.trainer import data_setup, launch
from moe_train.trainer.errors import TrainingError
from moe_train.trainer.loop import Trainer
from moe_train.trainer.mfu import run_peak_tflops
from moe_train.trainer.schedule import train_lr_at
from moe_train.trainer.start_warnings import warn_about_settings
from qa128_effects import Ctx, effect, one_step_runtime, setf, steps, warned, world1


# ---- data -------------------------------------------------------------------------------------------------------

@effect("data.path", what="the folder the run reads (a missing one is refused naming it)")
def check_data_path(ctx: Ctx, name: str) -> None:
    from moe_train.data import DataError

    trainer = Trainer(ctx.cfg())
    assert trainer.data_dir == ctx.data
    trainer.runtime.close()
    trainer._release_run_dir()
    with pytest.raises(DataError, match="nowhere"):
        Trainer(ctx.cfg(**{name: str(ctx.tmp / "nowhere")}))


CORPUS = {"data.cache_dir": "elsewhere", "data.default_vocab_size": 300, "data.default_max_bytes": 1000,
          "data.eval_fraction": 0.25}


@effect(*CORPUS, what="the embedded corpus's folder and prepare_data's arguments; warned as ignored with a folder")
def check_corpus_fields(ctx: Ctx, name: str, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(data_setup, "stdlib_documents", lambda n: calls.append(("bytes", n)) or ["doc"])
    monkeypatch.setattr(data_setup, "prepare_data", lambda docs, folder, **kw: calls.append((folder, kw)))
    value = CORPUS[name]
    if name == "data.cache_dir":
        value = str(ctx.tmp / value)
    d = dataclasses.replace(DataConfig(), path="default", cache_dir=str(ctx.tmp / "cache"))
    setf(d, name.split(".")[1], value)
    folder = data_setup.resolve_data_dir(d, is_main=True)
    (bytes_call, n), (prepared, kw) = calls
    assert prepared == folder
    got = {"data.cache_dir": str(folder.parent), "data.default_vocab_size": kw["vocab_size"],
           "data.default_max_bytes": n, "data.eval_fraction": kw["eval_fraction"]}[name]
    assert got == value
    assert folder != data_setup.default_data_dir(DataConfig(cache_dir=str(ctx.tmp / "cache")))
    text = warned(lambda: build_config("tiny", overrides={"data.path": str(ctx.data), name: CORPUS[name]}))
    assert f"{name}=" in text and "is ignored" in text


@effect("data.seq_len", what="the length of every training window")
def check_seq_len(ctx: Ctx, name: str) -> None:
    _, _, shapes = ctx.run(ctx.cfg(**{name: 16, "train.steps": 1}))
    assert shapes == [(4, 16)]


@effect("data.seed", "train.seed", what="data.seed: the window order, not the init; train.seed: the init, not the order")
def check_seeds(ctx: Ctx, name: str) -> None:
    def first(cfg):  # noqa: ANN001, ANN202
        trainer = Trainer(cfg)
        x, _ = trainer.sampler.next_batch(4)
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.runtime.close()
        trainer._release_run_dir()
        return x, weights

    (x0, w0), (x1, w1) = first(ctx.cfg()), first(ctx.cfg(**{name: 7}))
    same_init = all(torch.equal(w0[k], w1[k]) for k in w0)
    assert (not torch.equal(x0, x1), same_init) == ((True, True) if name == "data.seed" else (False, False))


# ---- train ------------------------------------------------------------------------------------------------------

@effect("train.steps", "train.log_interval", what="the step records metrics.jsonl gets")
def check_step_records(ctx: Ctx, name: str) -> None:
    value = {"train.steps": 3, "train.log_interval": 2}[name]
    _, records, _ = ctx.run(ctx.cfg(**{name: value}))
    assert [r["step"] for r in steps(records)] == ([1, 2, 3] if name == "train.steps" else [2])


@effect("train.micro_batch_size", "train.grad_accum", what="the forwards of a step and their batch size")
def check_batching(ctx: Ctx, name: str) -> None:
    _, records, shapes = ctx.run(ctx.cfg(**{name: 2, "train.steps": 1}))
    assert shapes == ([(2, 32)] if name == "train.micro_batch_size" else [(4, 32), (4, 32)])


LR_CHANGES = {"train.lr": 1e-3, "train.min_lr_ratio": 0.5, "train.warmup_steps": 3, "train.lr_schedule": "linear",
              "train.lr_decay_fraction": 0.5}


@effect(*LR_CHANGES, what="the lr trajectory (closed forms), which the optimizer steps with")
def check_lr(ctx: Ctx, name: str) -> None:
    base = {"train.steps": 10, "train.warmup_steps": 1, "train.lr": 3e-3, "train.min_lr_ratio": 0.1}
    if name == "train.lr_decay_fraction":
        base["train.lr_schedule"] = "wsd"
    cfg = ctx.cfg(**{**base, name: LR_CHANGES[name]})
    t = cfg.train
    lrs = [train_lr_at(s, t) for s in range(10)]
    lr, lo = t.lr, t.lr * t.min_lr_ratio
    cosine = [lr] + [lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * (s - 1) / 9)))
                     for s in range(1, 10)]
    want = {
        "train.lr": cosine,
        "train.min_lr_ratio": cosine,
        "train.warmup_steps": [lr / 3, 2 * lr / 3, lr] + [lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 7)))
                                                          for s in range(3, 10)],
        "train.lr_schedule": [lr] + [lr - (lr - lo) * (s - 1) / 9 for s in range(1, 10)],
        "train.lr_decay_fraction": [lr] * 6 + [lr - (lr - lo) * (s - 5) / 5 for s in range(6, 10)],  # last 5 of 10
    }[name]
    assert lrs == pytest.approx(want, rel=1e-12)
    if name == "train.lr":  # the Trainer steps with them: records and the optimizer's lr
        cfg.train.steps = 2
        trainer, records, _ = ctx.run(cfg)
        assert [r["lr"] for r in steps(records)] == [train_lr_at(s, cfg.train) for s in range(2)] == [1e-3, 1e-3]
        assert trainer.runtime.optimizer.param_groups[0]["lr"] == 1e-3
    if name == "train.min_lr_ratio":  # constant never decays to it: warned
        cfg = ctx.cfg(**{"train.lr_schedule": "constant", name: 0.5})
        assert "train.min_lr_ratio=0.5" in warned(lambda: warn_about_settings(cfg, torch.device("cpu")))


@effect("train.weight_decay", "train.beta1", "train.beta2", "train.eps",
        what="AdamW's settings on one process and in the distributed optimizer, and the moments after a step")
def check_adamw(ctx: Ctx, name: str) -> None:
    value = {"train.weight_decay": 0.0, "train.beta1": 0.5, "train.beta2": 0.7, "train.eps": 1e-3}[name]
    cfg = ctx.cfg(**{name: value, "train.grad_clip": 0.0})
    t = cfg.train
    rt = one_step_runtime(cfg)
    decay, no_decay = rt.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["betas"], decay["eps"]) == (
        t.weight_decay, 0.0, (t.beta1, t.beta2), t.eps)
    assert {p.dim() for p in decay["params"]} >= {2, 3} and {p.dim() for p in no_decay["params"]} == {1}
    for pname, p in rt.model.named_parameters():
        st, g = rt.optimizer.state[p], rt.grads[pname]
        torch.testing.assert_close(st["exp_avg"], (1 - t.beta1) * g)
        torch.testing.assert_close(st["exp_avg_sq"], (1 - t.beta2) * g * g)
    for distributed_optimizer in (True, False):  # moe-parallel's DistributedAdamW (world 1: bf16 weights)
        dcfg = ctx.cfg(**{name: value, "parallel.param_dtype": "bf16",
                          "parallel.distributed_optimizer": distributed_optimizer})
        with world1(dcfg) as d:
            c = d.rt.optimizer.cfg
            assert (c.betas, c.eps, c.weight_decay) == ((t.beta1, t.beta2), t.eps, t.weight_decay)
    fcfg = ctx.cfg(**{name: value, "parallel.strategy": "fsdp"})  # the FSDP2 baseline's torch AdamW
    with world1(fcfg) as d:
        group = d.rt.torch_optimizer.param_groups[0]
        assert (group["betas"], group["eps"], group["weight_decay"]) == ((t.beta1, t.beta2), t.eps, t.weight_decay)


@effect("train.grad_clip", what="the gradient reaching AdamW is clipped to that global norm (0: not clipped)")
def check_grad_clip(ctx: Ctx, name: str) -> None:
    for clip in (1e-3, 0.0):
        rt = one_step_runtime(ctx.cfg(**{name: clip}))
        norm = rt.result.grad_norm
        moments = torch.stack([rt.optimizer.state[p]["exp_avg"].norm() for p in rt.model.parameters()]).norm()
        assert norm > 1e-2
        assert moments.item() == pytest.approx(0.1 * (min(norm, clip) if clip else norm), rel=1e-4)


@effect("train.eval_interval", "train.eval_windows", what="the eval records, and the number of eval sequences")
def check_eval(ctx: Ctx, name: str) -> None:
    if name == "train.eval_interval":
        _, records, _ = ctx.run(ctx.cfg(**{name: 1}))
        assert [r["step"] for r in records if "eval_loss" in r] == [0, 1, 2]
    else:
        trainer = Trainer(ctx.cfg(**{name: 5, "train.eval_interval": 1}))
        assert sum(x.shape[0] for x, _ in trainer.eval_data) == 5
        trainer.runtime.close()
        trainer._release_run_dir()


@effect("train.save_interval", "train.keep_last", "train.async_save", "train.run_dir",
        what="the checkpoints written, how many are kept, the async writer's record, where")
def check_saves(ctx: Ctx, name: str) -> None:
    value = {"train.save_interval": 1, "train.keep_last": 1, "train.async_save": True,
             "train.run_dir": str(ctx.tmp / "chosen")}[name]
    cfg = ctx.cfg(**{"train.save_interval": 1, "train.keep_last": 3, "train.steps": 3, name: value})
    _, records, _ = ctx.run(cfg)
    kept = sorted(int(p.name.split("-")[1]) for p in (Path(cfg.train.run_dir) / "checkpoints").glob("step-*"))
    assert kept == ([3] if name == "train.keep_last" else [1, 2, 3])
    assert any(r.get("event") == "async_save" for r in records) == (name == "train.async_save")
    if name == "train.run_dir":
        assert (ctx.tmp / "chosen" / "metrics.jsonl").is_file()


@effect("train.resume", "train.init_from", what="where the run starts: the checkpoint's step, or its weights at step 0")
def check_start(ctx: Ctx, name: str) -> None:
    first = ctx.cfg(**{"train.save_interval": 2})
    trainer, _, _ = ctx.run(first)
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    if name == "train.resume":
        again = ctx.cfg(**{"train.steps": 3, "train.save_interval": 2, "train.run_dir": first.train.run_dir})
        _, records, _ = ctx.run(again)
        assert [r for r in records if r.get("event") == "start"][-1]["resumed_from_step"] == 2
        with pytest.raises(Exception, match="train.run_dir"):  # another run's history is not trained over
            ctx.run(ctx.cfg(**{"train.steps": 3, "train.run_dir": first.train.run_dir, name: False}))
    else:
        cfg = ctx.cfg(**{name: first.train.run_dir, "train.steps": 1})
        trainer = Trainer(cfg)
        real = trainer._train_step
        seen = {}

        def step():  # noqa: ANN202
            seen.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
            return real()
        trainer._train_step = step
        trainer.train()
        assert all(torch.equal(seen[k], saved[k]) for k in saved)


@effect("train.device", "train.autocast_bf16", what="CPU: cuda refused with no GPU; autocast never on the CPU")
def check_device(ctx: Ctx, name: str) -> None:
    if name == "train.device":
        assert launch.pick_device("cpu") == launch.pick_device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match="train.device='cuda'"):
            Trainer(ctx.cfg(**{name: "cuda"}))
    else:
        cfg = ctx.cfg(**{name: False, "train.steps": 1})
        _, off, _ = ctx.run(cfg)
        trainer, on, _ = ctx.run(ctx.cfg(**{"train.steps": 1}))
        assert trainer.autocast is False and steps(off)[0]["loss"] == steps(on)[0]["loss"]
        assert run_peak_tflops(cfg, torch.device("cpu")) is None


@effect("train.activation_checkpointing", "train.compile", what="what each block recomputes; compiled modules")
def check_runtime_choices(ctx: Ctx, name: str) -> None:
    value = "mlp" if name == "train.activation_checkpointing" else True
    trainer = Trainer(ctx.cfg(**{name: value}))
    m = trainer.model
    assert [b.recompute for b in m.blocks] == ["mlp", "mlp"] if value == "mlp" else m.compiled is True
    trainer.runtime.close()
    trainer._release_run_dir()


@effect("train.loss_chunk_tokens", what="the model's loss chunks; the same losses; no whole logits kept for backward")
def check_loss_chunks(ctx: Ctx, name: str) -> None:
    trainer, chunked, _ = ctx.run(ctx.cfg(**{name: 9}))
    assert trainer.model.loss_chunk_tokens == 9
    _, plain, _ = ctx.run(ctx.cfg())
    torch.testing.assert_close([r["loss"] for r in steps(chunked)], [r["loss"] for r in steps(plain)], rtol=1e-5,
                               atol=1e-6)
    sizes = []
    x = torch.randint(0, trainer.cfg.model.vocab_size, (4, trainer.cfg.data.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        trainer.model.loss(x, x)
    assert max(sizes) < x.numel() * trainer.cfg.model.vocab_size


@effect("train.lm_z_loss_weight", what="the LM head's z-loss: logged as lm_z_loss, and it changes the training")
def check_lm_z_loss(ctx: Ctx, name: str) -> None:
    trainer, with_z, _ = ctx.run(ctx.cfg(**{name: 0.05}))
    assert trainer.model.lm_z_loss_weight == 0.05
    _, plain, _ = ctx.run(ctx.cfg())
    assert all(r["lm_z_loss"] > 0 for r in steps(with_z)) and all("lm_z_loss" not in r for r in steps(plain))
    # the first step's loss is the same cross-entropy (the z-loss only changes the update; summed in another order
    # there); the second step's differs by more than that rounding
    first, second = (abs(steps(with_z)[i]["loss"] - steps(plain)[i]["loss"]) for i in (0, 1))
    assert first < 1e-5 < second, (first, second)


@effect("train.document_masking", what="the model's document mask from the data's eos_id")
def check_document_masking(ctx: Ctx, name: str) -> None:
    trainer, _, _ = ctx.run(ctx.cfg(**{name: True}))
    assert trainer.model.document_eos_id == trainer.meta["eos_id"]
    plain_trainer, _, _ = ctx.run(ctx.cfg())
    assert plain_trainer.model.document_eos_id is None
    x, _ = trainer.sampler.next_batch(4, 0, 1)
    x[:, ::5] = trainer.meta["eos_id"]  # documents of 5 tokens: the mask changes every later position's logits
    causal = copy.deepcopy(trainer.model)
    causal.set_document_masking(None)
    with torch.no_grad():
        assert not torch.allclose(trainer.model(x)[0][:, 6:], causal(x)[0][:, 6:], atol=1e-4)


@effect("train.document_masking_kernel", what="how attention applies the document mask (FlexAttention or SDPA)")
def check_document_masking_kernel(ctx: Ctx, name: str) -> None:
    trainer, _, _ = ctx.run(ctx.cfg(**{"train.document_masking": True, name: "sdpa"}))
    assert trainer.model.document_mask_kernel == "sdpa"
    assert trainer.model.document_masking_path(torch.device("cuda"), torch.bfloat16) == "sdpa"
    # FlexAttention has no CPU backward: 'flex' on this CPU is refused when the trainer is built, before any step
    with pytest.raises(ValueError, match="document_masking_kernel='flex'"):
        Trainer(ctx.cfg(**{"train.document_masking": True, name: "flex"}))


@effect("train.progress", what="the progress bar and lines on the terminal")
def check_progress(ctx: Ctx, name: str, capsys) -> None:
    ctx.run(ctx.cfg(**{"train.steps": 1, "train.eval_interval": 1, name: False}))
    quiet = capsys.readouterr()
    ctx.run(ctx.cfg(**{"train.steps": 1, "train.eval_interval": 1, name: True}))
    loud = capsys.readouterr()
    assert "eval loss" not in quiet.out + quiet.err and "step 1: eval loss" in loud.out + loud.err


@effect("train.threads", what="torch.get_num_threads() from the Trainer's start")
def check_threads(ctx: Ctx, name: str) -> None:
    before = torch.get_num_threads()
    try:
        target = 1 if before != 1 else 2
        trainer = Trainer(ctx.cfg(**{name: target}))
        assert torch.get_num_threads() == target
        trainer.runtime.close()
        trainer._release_run_dir()
    finally:
        torch.set_num_threads(before)


@effect("train.max_skipped_steps", what="how many non-finite steps in a row the run tolerates")
def check_max_skipped(ctx: Ctx, name: str) -> None:
    def poisoned(cfg):  # noqa: ANN001, ANN202
        trainer = Trainer(cfg)
        real = trainer.model.loss_terms
        trainer.model.loss_terms = lambda x, y: (lambda t: t._replace(ce=t.ce + float("inf")))(real(x, y))
        return trainer

    assert poisoned(ctx.cfg(**{name: 3, "train.steps": 2})).train()["skipped_steps"] == 2
    with pytest.raises(TrainingError, match=r"for 2 consecutive steps \(steps 1 to 2\); train.max_skipped_steps=2"):
        poisoned(ctx.cfg(**{name: 2, "train.steps": 3})).train()
