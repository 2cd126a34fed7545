"""train.activation_checkpointing: recomputing blocks ("full") or their feed-forward part ("mlp") in backward
changes what is kept for backward, and nothing else.

Same loss, gradients, updated weights and router statistics as "none" (fp32 on CPU: to rounding or exactly),
with softmax and sigmoid + expert-bias routers, random routing, shared expert on and off, bf16 autocast and
grad_accum 2; on four gloo ranks (DP2 x EP2 with a capacity that drops rows and the global balancing loss,
and the FSDP2 baseline); through the Trainer, a resume across modes and the CLI. The activations kept for
backward are counted to show the recompute really happens.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import activation_checkpointing_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from conftest import small_config  # noqa: E402

from moe_ckpt import load_checkpoint, step_dir  # noqa: E402
from moe_train.cli import main  # noqa: E402
from moe_train.config import Config, ConfigError, ModelConfig, RouterConfig, TrainConfig  # noqa: E402
from moe_train.config_io import build_config, config_from_dict, parse_overrides  # noqa: E402
from moe_train.model import Transformer  # noqa: E402
from moe_train.model import transformer  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402
from moe_train.trainer.runtime import LocalRuntime  # noqa: E402

VOCAB, SEQ, BATCH = 128, 32, 4


def model_config(**router) -> ModelConfig:
    """Three layers (the first dense), four experts, top-2."""
    shared, backend = router.pop("shared_expert_hidden", 16), router.pop("gemm_backend", "auto")
    return ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, qk_norm=True,
                       dense_hidden=64, dense_layers=[0], num_experts=4, expert_hidden=32,
                       shared_expert_hidden=shared, gemm_backend=backend, router=RouterConfig(top_k=2, **router))


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(n)]


def one_step(mode: str, model_cfg: ModelConfig, autocast: bool = False, device: str = "cpu") -> dict:
    """One optimizer step of two micro-batches through LocalRuntime (which hands the mode to the model):
    losses, gradients before the update, weights after it, every router's statistics and balancing load."""
    cfg = Config(model=model_cfg, train=TrainConfig(grad_accum=2, device=device, activation_checkpointing=mode))
    torch.manual_seed(0)  # random routing draws from the global generator (CPU and CUDA)
    rt = LocalRuntime(cfg, torch.device(device))
    model = rt.setup(Transformer(model_cfg, device="meta"))
    losses = []
    for i, b in enumerate(batches(2)):
        b = b.to(device)
        with torch.autocast(device, dtype=torch.bfloat16) if autocast else nullcontext():
            ce, aux = model.loss(b[:, :-1], b[:, 1:])
        rt.backward((ce + aux) / 2, last_micro_batch=i == 1)
        losses += [ce.detach(), aux.detach()]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    load = [router.step_load.clone() for _, router in model.routers()]
    result = rt.step(1e-3)
    for _, router in model.routers():
        router.update_expert_bias()
    stats = [router.take_stats() for _, router in model.routers()]
    return {"losses": torch.stack(losses), "grads": grads, "grad_norm": result.grad_norm, "load": load,
            "stats": stats, "health": [router.health(s) for (_, router), s in zip(model.routers(), stats)],
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-6, atol: float = 1e-9) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


VARIANTS = {
    "softmax_shared_expert": (model_config(), False),
    "sigmoid_expert_bias_no_shared_expert": (model_config(gating="sigmoid", expert_bias=True,
                                                          shared_expert_hidden=0), False),
    "random_routing": (model_config(routing="random"), False),
    "bf16_autocast": (model_config(expert_bias=True), True),
}


@pytest.mark.parametrize("mode", ["full", "mlp"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_recompute_gives_the_same_step_as_keeping_activations(variant, mode):
    """Losses, every gradient, the updated weights and buffers, the router statistics (counted once) and
    the balancing load: as with "none". Random routing only matches if the rerun draws the same experts."""
    model_cfg, autocast = VARIANTS[variant]
    want, got = one_step("none", model_cfg, autocast), one_step(mode, model_cfg, autocast)
    assert_close(got["losses"], want["losses"], "losses")
    assert set(got["grads"]) == set(want["grads"]) == {n for n, _ in Transformer(model_cfg).named_parameters()}
    for name, g in want["grads"].items():
        assert_close(got["grads"][name], g, f"grad of {name}")
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    for name, v in want["state"].items():
        assert_close(got["state"][name], v, name)
    for layer, (a, b) in enumerate(zip(got["load"], want["load"])):
        assert torch.equal(a, b), (layer, a, b)
    for layer, (a, b) in enumerate(zip(got["stats"], want["stats"])):
        assert_close(a, b, f"router stats of MoE layer {layer}")
    assert got["health"] == want["health"] and want["health"][0]["tokens"] == 2 * BATCH * SEQ


@pytest.mark.parametrize("mode", ["full", "mlp"])
def test_a_second_backward_through_a_retained_graph_recomputes_again_and_counts_once(mode):
    """Autograd reruns a part once per backward that needs it (here two through one retained graph): each
    rerun still counts nothing (the recompute context is entered twice)."""
    def run(mode: str) -> tuple[dict, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = Transformer(model_config())
        model.set_activation_checkpointing(mode)
        b = batches(1)[0]
        ce, aux = model.loss(b[:, :-1], b[:, 1:])
        (ce + aux).backward(retain_graph=True)
        (ce + aux).backward()
        return {n: p.grad for n, p in model.named_parameters()}, [r.take_stats() for _, r in model.routers()]

    (want_grads, want_stats), (grads, stats) = run("none"), run(mode)
    for name, g in want_grads.items():
        assert_close(grads[name], g, f"grad of {name}")
    for a, b in zip(stats, want_stats):
        assert_close(a, b, "router stats")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["full", "mlp"])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_recompute_on_gpu_draws_the_same_random_experts_under_bf16_autocast(mode, backend):
    """The rerun restores the CUDA generator too (random routing on the GPU), under CUDA autocast and the
    GPU expert backends (auto times its plans inside the first forward, here inside the recomputed part).
    Wrong experts would move gradients by O(1); bf16 kernels may differ in rounding."""
    model_cfg = model_config(routing="random", expert_bias=True, gemm_backend=backend)
    want, got = one_step("none", model_cfg, True, "cuda"), one_step(mode, model_cfg, True, "cuda")
    assert_close(got["losses"], want["losses"], "losses", rtol=1e-3, atol=1e-5)
    for name, g in want["grads"].items():
        assert_close(got["grads"][name], g, f"grad of {name}", rtol=1e-2, atol=1e-4)
    for layer, (a, b) in enumerate(zip(got["load"], want["load"])):
        assert torch.equal(a, b), (layer, a, b)
    for layer, (a, b) in enumerate(zip(got["stats"], want["stats"])):
        assert_close(a, b, f"router stats of MoE layer {layer}", rtol=1e-4, atol=1e-4)


def test_a_model_that_cannot_recompute_trains_only_without_it():
    """The runtime takes any module (tests train small ones); only a Transformer knows how to recompute."""
    def setup(mode: str) -> torch.nn.Module:
        cfg = Config(model=model_config(), train=TrainConfig(device="cpu", activation_checkpointing=mode))
        return LocalRuntime(cfg, torch.device("cpu")).setup(torch.nn.Linear(2, 2))

    setup("none")
    with pytest.raises(ConfigError, match="train.activation_checkpointing='full': expected 'none' for a Linear"):
        setup("full")


def kept_for_backward(mode: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """Bytes one training forward keeps for backward: the tensors autograd saves (parameters left out;
    each storage once) and the inputs that recompute_in_backward keeps to rerun from."""
    model_cfg = model_config()
    cfg = Config(model=model_cfg, train=TrainConfig(device="cpu", activation_checkpointing=mode))
    model = LocalRuntime(cfg, torch.device("cpu")).setup(Transformer(model_cfg, device="meta"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    real = transformer.recompute_in_backward

    def keeping_inputs(owner, fn, *args):  # noqa: ANN001, ANN002, ANN202
        for a in args:
            if a is not None:  # (the document mask, when there is none)
                keep(a)
        return real(owner, fn, *args)

    monkeypatch.setattr(transformer, "recompute_in_backward", keeping_inputs)
    b = batches(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        ce, aux = model.loss(b[:, :-1], b[:, 1:])
    (ce + aux).backward()  # the recompute works from what was kept
    return sum(kept.values())


def test_recompute_keeps_far_fewer_activations_for_backward(monkeypatch):
    """Fails if the mode were ignored: "full" keeps only each block's input, "mlp" drops the experts' rows."""
    none, full, mlp = (kept_for_backward(mode, monkeypatch) for mode in ("none", "full", "mlp"))
    assert full < none / 4, (none, full)
    assert full < mlp < 0.7 * none, (none, mlp)


def test_eval_and_no_grad_forwards_do_not_recompute(monkeypatch):
    calls = []
    real = transformer.recompute_in_backward
    monkeypatch.setattr(transformer, "recompute_in_backward", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    model = Transformer(model_config())
    model.set_activation_checkpointing("full")
    tokens = batches(1)[0][:, :-1]
    with torch.no_grad():
        train_logits, _ = model(tokens)
    model.eval()
    eval_logits, _ = model(tokens)
    assert calls == [] and torch.equal(train_logits, eval_logits)
    model.train()
    model(tokens)
    assert len(calls) == 3  # one per block


def test_the_mode_changes_no_parameter_or_buffer_name():
    def names(mode: str) -> tuple[list[str], list[str]]:
        model = Transformer(model_config(expert_bias=True))
        model.set_activation_checkpointing(mode)
        return list(model.state_dict()), [n for n, _ in model.named_buffers()]

    assert names("full") == names("mlp") == names("none")
    with pytest.raises(ValueError, match="activation checkpointing 'attn': expected one of none, full, mlp"):
        Transformer(model_config()).set_activation_checkpointing("attn")


# ---- four gloo ranks --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ac4")
    h.start_ranks(h.run_guarded, args=(w.worker4, str(out_dir), h.free_port(), h.token_stream()), nprocs=4)
    return h.load_results(out_dir, 4)


def assert_same_training(results: list[dict], got_key: str, want_key: str) -> None:
    for rank, res in enumerate(results):
        got, want = res[got_key], res[want_key]
        assert got["recompute"] == [got_key.split("_")[1]] * 3, (rank, got["recompute"])
        assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), f"rank {rank} losses")
        assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), f"rank {rank} grad norms")
        for layer, (a, b) in enumerate(zip(got["stats"], want["stats"])):
            assert_close(a, b, f"rank {rank} router stats of MoE layer {layer}")
    got = h.assemble([res[got_key]["weights"] for res in results])
    want = h.assemble([res[want_key]["weights"] for res in results])
    assert set(got) == set(want)
    for name, v in want.items():
        assert_close(got[name], v, name)


@pytest.mark.parametrize("mode", ["full", "mlp"])
def test_dp2_ep2_training_with_dropped_rows_recomputes_the_same_steps(four_ranks, mode):
    """dp=4, ep=2 on gloo, capacity 1.0 and the global balancing loss: the rerun re-issues the all-to-alls and
    the all-reduce, drops the same rows, and counts each dropped row once."""
    assert_same_training(four_ranks, f"ep_{mode}", "ep_none")
    dropped = sum(float(s[-1]) for res in four_ranks for s in res["ep_none"]["stats"])
    assert dropped > 0  # the capacity bites: rows were dropped


def test_fsdp2_baseline_with_full_recompute_trains_the_same_steps(four_ranks):
    assert_same_training(four_ranks, "fsdp_full", "fsdp_none")


# ---- the trainer and the command line ----------------------------------------------------------------
def test_trainer_resumes_across_modes_into_the_same_checkpoint(tmp_path, data_dir, capsys):
    """2 steps with "none" against 1 step of `moe-train train --config c.yaml --train.activation_checkpointing=full`
    and a resume to step 2 with "mlp": the same checkpoint tensors under the same names."""
    def cfg(name: str, steps: int, mode: str) -> Config:
        c = small_config(tmp_path / name, steps=steps, save_interval=1, eval_interval=0, warmup_steps=1,
                         activation_checkpointing=mode)
        c.data.path = str(data_dir)
        return c

    Trainer(cfg("plain", 2, "none")).train()
    c = cfg("recomputed", 1, "none").to_dict()
    c.pop("preset")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c))
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--train.activation_checkpointing=full"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
    assert step_dir(tmp_path / "recomputed" / "run" / "checkpoints", 1).is_dir()  # written by the CLI run
    summary = Trainer(cfg("recomputed", 2, "mlp")).train()
    assert summary["step"] == 2
    want = load_checkpoint(step_dir(tmp_path / "plain" / "run" / "checkpoints", 2))
    got = load_checkpoint(step_dir(tmp_path / "recomputed" / "run" / "checkpoints", 2))
    assert set(got) == set(want)
    for name, v in want.items():
        assert torch.equal(got[name], v), name


def test_bench_recomputes_when_asked(capsys, monkeypatch):
    calls = []
    real = transformer.recompute_in_backward
    monkeypatch.setattr(transformer, "recompute_in_backward", lambda *a: calls.append(1) or real(*a))
    assert main(["bench", "--steps", "1", "--warmup", "0", "--model.num_layers=2", "--data.seq_len=16",
                 "--train.micro_batch_size=2", "--train.activation_checkpointing=mlp"]) == 0
    assert json.loads(capsys.readouterr().out)["activation_checkpointing"] == "mlp"
    assert len(calls) == 2  # one training forward, two blocks


def test_config_takes_the_mode_from_yaml_and_overrides_and_refuses_others(tmp_path, capsys):
    """"none" is a value here, not YAML's or Python's null (config_io reads the word as null elsewhere)."""
    assert build_config("tiny").train.activation_checkpointing == "none"
    stored = build_config("tiny", None, parse_overrides(["--train.activation_checkpointing=none"])).to_dict()
    assert config_from_dict(stored).train.activation_checkpointing == "none"  # as a checkpoint stores it
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  activation_checkpointing: none\n")
    assert build_config(None, str(y)).train.activation_checkpointing == "none"
    y.write_text("train:\n  activation_checkpointing: ~\n")
    with pytest.raises(ConfigError, match="train.activation_checkpointing=None: expected a string; this field cannot"):
        build_config(None, str(y))
    y.write_text("train:\n  activation_checkpointing: mlp\n")
    assert build_config(None, str(y)).train.activation_checkpointing == "mlp"
    cfg = build_config(None, str(y), parse_overrides(["--train.activation_checkpointing=full"]))
    assert cfg.train.activation_checkpointing == "full"
    assert main(["info", "--train.activation_checkpointing=full"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["train"]["activation_checkpointing"] == "full"
    message = "train.activation_checkpointing='selective': expected one of none, full, mlp"
    with pytest.raises(ConfigError, match=message):
        build_config("tiny", None, parse_overrides(["--train.activation_checkpointing=selective"]))
    y.write_text("train:\n  activation_checkpointing: selective\n")
    assert main(["info", "--config", str(y)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
