"""model.attention_bias (q/k/v biases) and model.rotary_fraction (partial rotary) through everything the trainer
does with attention weights: validation, initialisation, weight decay, parameter and FLOP accounting, activation
checkpointing, the single-process and the distributed (DP2 x EP2, ZeRO-1 FlatParams) optimizers, checkpoints that
resume on another layout, and the resume check of the model a checkpoint was written for.

Before: ModelConfig had neither field (every test here fails building its config).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import layout_resume_worker as w  # noqa: E402
from test_activation_checkpointing import assert_close, one_step  # noqa: E402
from test_check_same_model import checkpoint_of  # noqa: E402

from moe_ckpt import LoadRequest, find_latest, load_metadata, open_checkpoint  # noqa: E402
from moe_train.config import (  # noqa: E402
    Config, ConfigError, ModelConfig, RouterConfig, validate,
)
from moe_train.config_io import build_config  # noqa: E402
from moe_train.model import Transformer, count_params, flops_per_token  # noqa: E402
from moe_train.trainer.resume_checks import check_same_model  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402
from moe_train.trainer.schedule import param_groups  # noqa: E402

BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
# a resume at train.steps=6 of a run saved at steps=3 says its schedule differs (the 3-step run decays earlier)
pytestmark = pytest.mark.filterwarnings("ignore:the learning-rate schedule differs:UserWarning")


def model_config(**fields) -> ModelConfig:
    """Three layers (the first dense), four experts, head_dim 8 (half rotary: 4 dims), q/k/v biases."""
    kw = dict(vocab_size=128, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, qk_norm=True, dense_hidden=64,
              dense_layers=[0], num_experts=4, expert_hidden=32, shared_expert_hidden=16, attention_bias=True,
              rotary_fraction=0.5, router=RouterConfig(top_k=2, gating="sigmoid", expert_bias=True))
    return validate(Config(model=ModelConfig(**{**kw, **fields}))).model


def test_biases_start_at_zero_get_gradients_and_are_not_decayed():
    cfg = model_config()
    model = Transformer(cfg)
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert sorted(biases) == sorted(f"blocks.{i}.attn.{b}" for i in range(3) for b in BIASES)
    assert all(not p.any() for p in biases.values())
    assert biases["blocks.0.attn.q_proj.bias"].shape == (4 * 8,) and biases["blocks.0.attn.k_proj.bias"].shape == (16,)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
    (ce + aux).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in biases.values())
    decay, no_decay = param_groups(model, 0.1)
    assert no_decay["weight_decay"] == 0.0
    assert {id(p) for p in biases.values()} <= {id(p) for p in no_decay["params"]}
    assert not {id(p) for p in biases.values()} & {id(p) for p in decay["params"]}


@pytest.mark.parametrize("attention_bias", [False, True])
def test_parameter_count_matches_the_model_and_biases_add_no_model_flops(attention_bias):
    cfg = model_config(attention_bias=attention_bias)
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == count_params(cfg).total
    without = dataclasses.replace(cfg, attention_bias=False, rotary_fraction=1.0)
    extra = 3 * (4 + 2 * 2) * 8 if attention_bias else 0  # layers x (q heads + k, v heads) x head_dim
    assert count_params(cfg).total - count_params(without).total == extra
    assert count_params(cfg).active - count_params(without).active == extra
    assert flops_per_token(cfg, 128) == flops_per_token(without, 128)  # added, not multiplied; RoPE is elementwise


@pytest.mark.parametrize("mode", ["full", "mlp"])
def test_recompute_gives_the_same_step_with_biases_and_partial_rotary(mode):
    model_cfg = model_config()
    want, got = one_step("none", model_cfg), one_step(mode, model_cfg)
    assert_close(got["losses"], want["losses"], "losses")
    assert set(got["grads"]) == set(want["grads"]) >= {f"blocks.1.attn.{b}" for b in BIASES}
    for name, g in want["grads"].items():
        assert_close(got["grads"][name], g, f"grad of {name}")
    for name, v in want["state"].items():
        assert_close(got["state"][name], v, name)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(rotary_fraction=0.0), r"model\.rotary_fraction=0\.0: expected in \(0, 1\]"),
    (dict(rotary_fraction=1.5), r"model\.rotary_fraction=1\.5: expected in \(0, 1\]"),
    (dict(rotary_fraction=-0.5), r"model\.rotary_fraction=-0\.5: expected in \(0, 1\]"),
    (dict(rotary_fraction=0.3), r"model\.rotary_fraction=0\.3: expected a fraction of head_dim=8 that rotates a "
                                r"whole even number of dims \(RoPE rotates pairs; this one gives 2\.4\)"),
    (dict(rotary_fraction=0.125), r"model\.rotary_fraction=0\.125: expected .* this one gives 1\)"),
    (dict(rotary_fraction=float("nan")), r"model\.rotary_fraction=nan: expected a finite number"),
    (dict(attention_bias="yes"), r"model\.attention_bias='yes': expected true or false"),
])
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        model_config(**fields)


def test_partial_rotary_allows_an_odd_head_dim_and_the_fields_come_from_overrides():
    """Only the rotated dims pair up: head_dim 5 at 0.4 rotates 2 dims and passes 3; an odd head_dim rotated
    whole is refused as before."""
    cfg = model_config(head_dim=5, rotary_fraction=0.4)
    assert cfg.rotary_dim == 2 and cfg.resolved_head_dim == 5
    Transformer(cfg)(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"model\.head_dim=5: expected an even number"):
        model_config(head_dim=5, rotary_fraction=1.0)
    cfg = build_config("tiny", overrides={"model.attention_bias": "true", "model.rotary_fraction": "0.5"})
    assert cfg.model.attention_bias is True and cfg.model.rotary_fraction == 0.5
    assert cfg.to_dict()["model"]["attention_bias"] is True and cfg.to_dict()["model"]["rotary_fraction"] == 0.5


def run_config(root: Path, data: Path, name: str, steps: int, dp: int = 1, ep: int = 1) -> Config:
    model = model_config(vocab_size=512, num_layers=2, expert_hidden=16,
                         router=RouterConfig(top_k=2, gating="sigmoid", expert_bias=True, lb_loss_scope="global"))
    return w.run_config(model, data, root / name, steps, dp, ep)




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Unbroken 6-step runs on one process and on DP2 x EP2 (the distributed optimizer's FlatParams), a 3 + 3
    split on one process, and resumes across layouts at step 3 (one -> DP2xEP2, DP2xEP2 -> one)."""
    from moe_train.data import prepare_data, stdlib_documents

    root = tmp_path_factory.mktemp("bias_rotary")
    data = prepare_data(list(stdlib_documents(150_000)), root / "data", vocab_size=512, source="stdlib-test")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w.run_trainer(run_config(root, data, "one", 6))
        w.run_trainer(run_config(root, data, "split", 3))
        w.run_trainer(run_config(root, data, "split", 6))
        w.spawn(2, [
            (run_config(root, data, "dp2ep2", 6, dp=2, ep=2), None),
            (run_config(root, data, "one_to_dp2ep2", 6, dp=2, ep=2), (root / "one", root / "one_to_dp2ep2")),
        ], root / "spawn2")
        w.seed_run_dir(root / "dp2ep2", root / "dp2ep2_to_one")
        w.run_trainer(run_config(root, data, "dp2ep2_to_one", 6))
    finally:
        torch.set_num_threads(before)
    return root, data


def test_a_run_with_biases_and_half_rotary_trains_and_resumes_bit_identically(runs):
    root, _ = runs
    assert w.losses(root / "split") == w.losses(root / "one")
    path = find_latest(root / "one" / "checkpoints")
    assert load_metadata(path)["config"]["model"]["attention_bias"] is True
    assert load_metadata(path)["config"]["model"]["rotary_fraction"] == 0.5
    ckpt = open_checkpoint(path)
    try:
        names = set(ckpt.names)
        for b in BIASES:
            assert {f"blocks.1.attn.{b}", *(f"optim.blocks.1.attn.{b}.{s}" for s in ("exp_avg", "exp_avg_sq"))} <= names
        bias = ckpt.read([LoadRequest("blocks.1.attn.q_proj.bias")])["blocks.1.attn.q_proj.bias"]
    finally:
        ckpt.close()
    assert bias.abs().max() > 0  # trained away from its zero init


@pytest.mark.slow
@pytest.mark.parametrize(("resumed", "unbroken"), [("one_to_dp2ep2", "dp2ep2"), ("dp2ep2_to_one", "one")])
def test_a_checkpoint_with_biases_resumes_on_another_layout_like_an_unbroken_run(runs, resumed, unbroken):
    """The biases are sharded by the distributed optimizer (DP2 x EP2) and saved as global tensors: a checkpoint
    written on one layout resumes on the other and continues as the unbroken run there does."""
    root, _ = runs
    got, want = w.losses(root / resumed), w.losses(root / unbroken)
    assert sorted(got) == [4, 5, 6], got
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got[step], want[step])
    assert w.losses(root / "dp2ep2")[6] == pytest.approx(w.losses(root / "one")[6], rel=1e-5)
    path = find_latest(root / "dp2ep2" / "checkpoints")  # written by two ranks: the masters are global, whole
    ckpt = open_checkpoint(path)
    try:
        assert {f"optim.blocks.0.attn.{b}.master" for b in BIASES} <= set(ckpt.names)
    finally:
        ckpt.close()


@pytest.mark.parametrize(("saved", "run", "message"), [
    (dict(attention_bias=True), dict(), r"model\.attention_bias: checkpoint True, this run False"),
    (dict(), dict(rotary_fraction=0.5), r"model\.rotary_fraction: checkpoint 1\.0, this run 0\.5"),
])
def test_resume_into_another_attention_is_refused_naming_the_field(saved, run, message, tmp_path):
    path = checkpoint_of(tmp_path, Config(model=ModelConfig(**saved)).to_dict())
    with pytest.raises(ConfigError, match=message):
        check_same_model(path, Config(model=ModelConfig(**run)))
    check_same_model(path, Config(model=ModelConfig(**saved)))


def test_a_checkpoint_that_predates_the_fields_is_compared_with_their_defaults(tmp_path):
    old = Config().to_dict()
    del old["model"]["attention_bias"], old["model"]["rotary_fraction"]
    path = checkpoint_of(tmp_path, old)
    check_same_model(path, Config())
    with pytest.raises(ConfigError, match=r"model\.attention_bias: checkpoint \(not recorded: False\), this run True"):
        check_same_model(path, Config(model=ModelConfig(attention_bias=True)))
    with pytest.raises(ConfigError, match=r"model\.rotary_fraction: checkpoint \(not recorded: 1\.0\), this run 0\.5"):
        check_same_model(path, Config(model=ModelConfig(rotary_fraction=0.5)))


def test_the_trainer_refuses_to_resume_a_run_with_other_attention(runs, tmp_path):
    root, data = runs
    w.seed_run_dir(root / "one", tmp_path / "other")
    cfg = run_config(tmp_path, data, "other", 6)
    cfg.model.rotary_fraction = 1.0
    with pytest.raises(ConfigError, match=r"model\.rotary_fraction: checkpoint 0\.5, this run 1\.0"):
        Trainer(cfg).train()
    assert w.losses(root / "one")  # the refused run wrote nothing into the run it was pointed at
