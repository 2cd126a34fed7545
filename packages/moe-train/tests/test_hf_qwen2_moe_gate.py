"""model.shared_expert_gate: Qwen1.5-MoE / Qwen2-MoE's learned per-token gate on the shared expert,
sigmoid(x . w) x shared(x), through the model, training, checkpoints and the Hugging Face import and export.

A transformers-written Qwen2-MoE folder with a learned gate imports computing transformers' logits, exports back
to the same tensors, and an ungated model exports as before (gate pinned open, shared down_proj doubled) with
config.json saying so. Default off adds nothing to the model.

Before: ModelConfig had no such field (every test here fails building its config or on the field's absence), and
import refused any non-zero shared_expert_gate ("has no counterpart in moe-train").
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import folder_tensors, hf_logits, our_logits, one_thread  # noqa: E402,F401 - one_thread: autouse
import layout_resume_worker as w  # noqa: E402
from test_activation_checkpointing import assert_close, one_step  # noqa: E402
from test_check_same_model import checkpoint_of  # noqa: E402

from moe_ckpt import LoadRequest, find_latest, load_metadata, open_checkpoint  # noqa: E402
from moe_ckpt.hf import HFConversionError, export_hf_folder, from_hf_config  # noqa: E402
from moe_train.config import Config, ConfigError, ModelConfig, RouterConfig, validate  # noqa: E402
from moe_train.hf_bridge import export_hf, import_hf  # noqa: E402
from moe_train.model import MoELayer, Transformer, count_params, flops_per_token  # noqa: E402
from moe_train.trainer.resume_checks import check_same_model  # noqa: E402
from moe_train.trainer.schedule import param_groups  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.filterwarnings("ignore:export of .*no tokenizer found:UserWarning"),
              # a resume at train.steps=6 of a run saved at steps=3 says its schedule differs
              pytest.mark.filterwarnings("ignore:the learning-rate schedule differs:UserWarning")]

VOCAB, D, LAYERS, EXPERTS = 96, 32, 3, 4
GATE = "mlp.shared_expert_gate.weight"
KEY = "moe_train_shared_expert_gate"
QWEN2_SIZES = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=48, moe_intermediate_size=16,
                   shared_expert_intermediate_size=24, num_hidden_layers=LAYERS, num_attention_heads=4,
                   num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=2, mlp_only_layers=[0],
                   initializer_range=0.1)




def model_config(**fields) -> ModelConfig:
    """Three layers (the first dense), four experts top-2, a shared expert (24) behind a learned gate."""
    kw = dict(vocab_size=VOCAB, d_model=D, num_layers=LAYERS, num_heads=4, num_kv_heads=2, dense_hidden=48,
              dense_layers=[0], num_experts=EXPERTS, expert_hidden=16, shared_expert_hidden=24, attention_bias=True,
              shared_expert_gate=True, init_std=0.1, rope_theta=500.0, router=RouterConfig(top_k=2))
    return validate(Config(model=ModelConfig(**{**kw, **fields}))).model


def set_gates(model: torch.nn.Module, suffix: str) -> dict[str, torch.Tensor]:
    """Every shared-expert gate set to explicit non-zero values (some tokens mostly closed, some open)."""
    g = torch.Generator().manual_seed(7)
    gates = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffix):
                p.copy_(torch.randn(p.shape, generator=g))
                gates[name] = p.detach().clone()
    assert gates and all(v.abs().min() > 0 for v in gates.values())
    return gates


def qwen2_folder(folder: Path) -> dict[str, torch.Tensor]:
    """A tiny fp32 Qwen2-MoE written by transformers' save_pretrained, its gates learned-looking (non-zero)."""
    cfg = transformers.Qwen2MoeConfig(**QWEN2_SIZES, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    gates = set_gates(model, "shared_expert_gate.weight")
    assert sorted(gates) == [f"model.layers.{i}.{GATE}" for i in (1, 2)]
    model.save_pretrained(folder)
    assert KEY not in json.loads((folder / "config.json").read_text())
    return gates


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2") / "native"
    qwen2_folder(folder)
    return folder






def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))




def test_a_qwen2_moe_folder_with_a_learned_gate_imports_computing_transformers_logits(native, tmp_path):
    cfg, state = import_hf(native, tmp_path / "ours")
    assert cfg.model.shared_expert_gate is True and cfg.model.shared_expert_hidden == 24
    tensors = folder_tensors(native)
    for i in (1, 2):
        assert torch.equal(state[f"blocks.{i}.{GATE}"], tensors[f"model.layers.{i}.{GATE}"])
        # the gate is learned, so the shared expert comes as it is (not halved, as a pinned-open one is)
        assert torch.equal(state[f"blocks.{i}.mlp.shared_expert.down.weight"],
                           tensors[f"model.layers.{i}.mlp.shared_expert.down_proj.weight"])
    assert f"blocks.0.{GATE}" not in state  # layer 0 is dense (mlp_only_layers)
    ids = token_ids()
    want = hf_logits(native, ids)
    diff = (our_logits(cfg.model, state, ids) - want).abs().max().item()
    assert diff < 1e-4, diff
    # the gate is what makes them agree: the same weights ungated (x 1), or pinned open (x 0.5), are far off
    ungated = {k: v for k, v in state.items() if not k.endswith(GATE)}
    off = dataclasses.replace(cfg.model, shared_expert_gate=False)
    assert (our_logits(off, ungated, ids) - want).abs().max().item() > 1e-2
    pinned = {k: torch.zeros_like(v) if k.endswith(GATE) else v for k, v in state.items()}
    assert (our_logits(cfg.model, pinned, ids) - want).abs().max().item() > 1e-2


def test_import_export_import_of_a_learned_gate_is_exact(native, tmp_path):
    cfg, state = import_hf(native, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "again", dtype="fp32")
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    assert KEY not in written and written["shared_expert_intermediate_size"] == 24
    first, again = folder_tensors(native), folder_tensors(tmp_path / "again")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    cfg2, state2 = import_hf(tmp_path / "again")
    assert cfg2.model == cfg.model
    assert state2.keys() == state.keys() and all(torch.equal(state2[k], v) for k, v in state.items())
    ids = token_ids()
    assert (hf_logits(tmp_path / "again", ids) - hf_logits(native, ids)).abs().max().item() == 0


def test_our_gated_model_exports_to_a_folder_transformers_computes_exactly(tmp_path):
    torch.manual_seed(0)
    model = Transformer(model_config()).eval()
    gates = set_gates(model, GATE)
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    assert KEY not in json.loads((tmp_path / "hf" / "config.json").read_text())
    tensors = folder_tensors(tmp_path / "hf")
    for i in (1, 2):
        assert torch.equal(tensors[f"model.layers.{i}.{GATE}"], gates[f"blocks.{i}.{GATE}"])
        assert torch.equal(tensors[f"model.layers.{i}.mlp.shared_expert.down_proj.weight"],
                           model.state_dict()[f"blocks.{i}.mlp.shared_expert.down.weight"])
    ids = token_ids()
    with torch.no_grad():
        ours = model(ids)[0]
    diff = (hf_logits(tmp_path / "hf", ids) - ours).abs().max().item()
    assert diff < 1e-4, diff
    cfg, state = import_hf(tmp_path / "hf")
    assert cfg.model == model.cfg
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_an_ungated_model_still_exports_pinned_open_and_says_so(tmp_path):
    """shared_expert_gate off: the gate is written as zeros (sigmoid = 0.5) and the shared down_proj doubled, as
    before, and config.json's moe_train_shared_expert_gate=false brings back the ungated model on import."""
    torch.manual_seed(0)
    model = Transformer(model_config(shared_expert_gate=False)).eval()
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())[KEY] is False
    tensors = folder_tensors(tmp_path / "hf")
    assert not tensors[f"model.layers.1.{GATE}"].any()
    assert torch.equal(tensors["model.layers.1.mlp.shared_expert.down_proj.weight"],
                       2 * model.state_dict()["blocks.1.mlp.shared_expert.down.weight"])
    ids = token_ids()
    with torch.no_grad():
        ours = model(ids)[0]
    assert (hf_logits(tmp_path / "hf", ids) - ours).abs().max().item() < 1e-4
    cfg, state = import_hf(tmp_path / "hf")
    assert cfg.model == model.cfg and cfg.model.shared_expert_gate is False
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_an_export_that_predates_the_key_imports_gated_computing_the_same_logits(tmp_path):
    """moe-ckpt <= 0.8 wrote ungated models pinned open without the key: such a folder reads as a Qwen2-MoE one
    (a learned gate, here zero) and computes exactly what the ungated model did."""
    torch.manual_seed(0)
    model = Transformer(model_config(shared_expert_gate=False)).eval()
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    path = tmp_path / "hf" / "config.json"
    written = json.loads(path.read_text())
    del written[KEY]
    path.write_text(json.dumps(written))
    cfg, state = import_hf(tmp_path / "hf")
    assert cfg.model == dataclasses.replace(model.cfg, shared_expert_gate=True)
    assert not state[f"blocks.1.{GATE}"].any()
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(our_logits(cfg.model, state, ids), model(ids)[0])  # x 0.5 and x 2 are exact


@pytest.mark.parametrize(("config", "message"), [
    (dict(shared_expert_intermediate_size=0), None),
    ({KEY: "no"}, r"config\.json moe_train_shared_expert_gate='no': expected true or false"),
])
def test_the_gate_imports_only_with_a_shared_expert_and_a_well_formed_key(config, message):
    c = {"model_type": "qwen2_moe", **QWEN2_SIZES, **config}
    if message is None:
        assert from_hf_config(c)[0]["shared_expert_gate"] is False
    else:
        with pytest.raises(HFConversionError, match=message):
            from_hf_config(c)


def test_a_gated_model_with_sigmoid_gating_is_refused_by_the_export(tmp_path):
    model = Transformer(model_config(router=RouterConfig(gating="sigmoid", top_k=2), shared_expert_hidden=16))
    with pytest.raises(HFConversionError, match=r"shared_expert_gate=True with sigmoid gating \(GLM-4-MoE's shared "
                                                r"experts are not gated\).*nearest that exports: router\.gating="
                                                r"'softmax' with qk_norm=False \(Qwen2MoeForCausalLM\) or "
                                                r"shared_expert_gate=False"):
        export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("fields", "message"), [
    (dict(shared_expert_hidden=0), r"model\.shared_expert_gate=True: expected false with "
                                   r"model\.shared_expert_hidden=0 \(the gate scales the shared expert's output"),
    (dict(shared_expert_gate="yes"), r"model\.shared_expert_gate='yes': expected true or false"),
])
def test_a_gate_without_a_shared_expert_is_refused_naming_both_fields(fields, message):
    with pytest.raises(ConfigError, match=message):
        model_config(**fields)


def test_default_off_adds_no_parameter_and_no_operation():
    """The ungated layer is the routed output plus the shared expert's, bit for bit (forward and gradients)."""
    assert ModelConfig().shared_expert_gate is False
    cfg = model_config(shared_expert_gate=False)
    assert not any(GATE in n for n, _ in Transformer(cfg).named_parameters())
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == count_params(cfg).total
    unshared = dataclasses.replace(cfg, shared_expert_hidden=0)  # two MoE layers x three [d, 24] weights
    assert count_params(cfg).total - count_params(unshared).total == 2 * 3 * D * 24
    assert flops_per_token(cfg, 128) - flops_per_token(unshared, 128) == 6 * 2 * 3 * D * 24
    torch.manual_seed(0)
    from moe_precision import PrecisionRecipe

    layer = MoELayer(cfg, PrecisionRecipe(cfg.precision))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert layer.shared_expert_gate is None
    x = torch.randn(2, 5, D, requires_grad=True)
    out, _ = layer(x)
    got = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    shared, layer.shared_expert = layer.shared_expert, None
    routed, _ = layer(x)
    layer.shared_expert = shared
    want_out = (routed.reshape(-1, D) + shared(x.reshape(-1, D))).reshape(x.shape)
    assert torch.equal(out, want_out)
    want = torch.autograd.grad(want_out.square().sum(), [x, *layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
    # x's gradient sums the same branches, in an order that depends on how the reference's graph was built
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)


def test_the_gate_is_initialised_counted_and_decayed_like_a_linear():
    cfg = model_config()
    model = Transformer(cfg)
    gates = {n: p for n, p in model.named_parameters() if n.endswith(GATE)}
    assert sorted(gates) == [f"blocks.{i}.{GATE}" for i in (1, 2)] and gates[f"blocks.1.{GATE}"].shape == (1, D)
    before = {n: p.detach().clone() for n, p in gates.items()}
    model.reset_parameters(3)
    assert all(0.02 < p.std().item() < 0.2 and not torch.equal(p, before[n]) for n, p in gates.items())  # N(0, 0.1)
    model.reset_parameters(torch.initial_seed())
    assert all(torch.equal(p, before[n]) for n, p in gates.items())  # a function of (seed, name)
    decay, no_decay = param_groups(model, 0.1)
    assert {id(p) for p in gates.values()} <= {id(p) for p in decay["params"]}  # 2-D, as every Linear weight
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total
    off = dataclasses.replace(cfg, shared_expert_gate=False)
    assert count_params(cfg).total - count_params(off).total == 2 * D  # two MoE layers x Linear(d, 1)
    assert count_params(cfg).active - count_params(off).active == 2 * D
    assert flops_per_token(cfg, 128) - flops_per_token(off, 128) == 6 * 2 * D  # a matmul weight, as the router's


@pytest.mark.parametrize("mode", ["full", "mlp"])
def test_a_training_step_trains_the_gate_and_recompute_gives_the_same_step(mode):
    cfg = dataclasses.replace(model_config(vocab_size=128), qk_norm=True, attention_bias=False)
    want, got = one_step("none", cfg), one_step(mode, cfg)
    for i in (1, 2):
        grad = want["grads"][f"blocks.{i}.{GATE}"]
        assert grad.shape == (1, D) and grad.abs().sum() > 0
    assert_close(got["losses"], want["losses"], "losses")
    assert set(got["grads"]) == set(want["grads"])
    for name, g in want["grads"].items():
        assert_close(got["grads"][name], g, f"grad of {name}")
    for name, v in want["state"].items():
        assert_close(got["state"][name], v, name)


@pytest.mark.parametrize(("saved", "run", "message"), [
    (dict(shared_expert_gate=True, shared_expert_hidden=16), dict(shared_expert_hidden=16),
     r"model\.shared_expert_gate: checkpoint True, this run False"),
    (dict(shared_expert_hidden=16), dict(shared_expert_gate=True, shared_expert_hidden=16),
     r"model\.shared_expert_gate: checkpoint False, this run True"),
])
def test_resume_into_another_gate_is_refused_naming_the_field(saved, run, message, tmp_path):
    path = checkpoint_of(tmp_path, Config(model=ModelConfig(**saved)).to_dict())
    with pytest.raises(ConfigError, match=message):
        check_same_model(path, Config(model=ModelConfig(**run)))
    check_same_model(path, Config(model=ModelConfig(**saved)))


def test_a_checkpoint_that_predates_the_gate_is_compared_with_its_default(tmp_path):
    old = Config(model=ModelConfig(shared_expert_hidden=16)).to_dict()
    del old["model"]["shared_expert_gate"]
    path = checkpoint_of(tmp_path, old)
    check_same_model(path, Config(model=ModelConfig(shared_expert_hidden=16)))
    with pytest.raises(ConfigError, match=r"model\.shared_expert_gate: checkpoint \(not recorded: False\), "
                                          r"this run True"):
        check_same_model(path, Config(model=ModelConfig(shared_expert_hidden=16, shared_expert_gate=True)))


def run_config(root: Path, data: Path, name: str, steps: int, dp: int = 1, ep: int = 1) -> Config:
    model = model_config(vocab_size=512, num_layers=2, dense_layers=[], router=RouterConfig(top_k=2))
    return w.run_config(model, data, root / name, steps, dp, ep)




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Unbroken 6-step runs on one process and on DP2 x EP2 (the distributed optimizer's FlatParams), and a 3 + 3
    split on one process."""
    from moe_train.data import prepare_data, stdlib_documents

    root = tmp_path_factory.mktemp("gate_runs")
    data = prepare_data(list(stdlib_documents(150_000)), root / "data", vocab_size=512, source="stdlib-test")
    w.run_trainer(run_config(root, data, "one", 6))
    w.run_trainer(run_config(root, data, "split", 3))
    w.run_trainer(run_config(root, data, "split", 6))
    w.spawn(2, [(run_config(root, data, "dp2ep2", 6, dp=2, ep=2), None)], root / "spawn2")
    return root


def test_a_gated_run_checkpoints_resumes_bit_identically_and_matches_the_distributed_optimizer(runs):
    assert w.losses(runs / "split") == w.losses(runs / "one")
    # DP2 x EP2 sums gradients in another order: this config's ungated model drifts up to 3e-5 by step 6 too
    one, dist = w.losses(runs / "one"), w.losses(runs / "dp2ep2")
    assert sorted(dist) == list(range(1, 7)) and dist[1] == pytest.approx(one[1], rel=1e-6)
    assert all(dist[step] == pytest.approx(one[step], rel=5e-4) for step in one)
    for run in ("one", "dp2ep2"):
        path = find_latest(runs / run / "checkpoints")
        assert load_metadata(path)["config"]["model"]["shared_expert_gate"] is True
        ckpt = open_checkpoint(path)
        try:
            names = set(ckpt.names)
            stored = {f"optim.blocks.1.{GATE}.{s}" for s in ("exp_avg", "exp_avg_sq")}
            assert stored | {f"blocks.1.{GATE}"} <= names
            gate = ckpt.read([LoadRequest(f"blocks.1.{GATE}")])[f"blocks.1.{GATE}"]
        finally:
            ckpt.close()
        assert gate.shape == (1, D) and gate.abs().max() > 0
