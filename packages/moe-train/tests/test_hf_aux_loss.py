"""A custom-code export's labels loss with output_router_logits: CE + the router aux loss, exactly what moe-train's
trainer backpropagates for a micro-batch (loss, aux and every parameter's gradient match ours in fp32); off, the
loss is the cross-entropy as before; padded rows stay out of the router statistics; a dense model has no aux; import
refuses a config.json whose routing is not the learned one the modeling file computes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from moe_ckpt.hf import HFConversionError
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_home, one_thread, random_model  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.usefixtures("hf_home")  # transformers' caches in a temporary folder

BASE = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=40, num_experts=4,
            expert_hidden=16, init_std=0.1, rope_theta=1000.0, norm_eps=1e-5)
# balancing weights far above the defaults, so a missing or misweighted term shows in the loss and the gradients
WEIGHTS = dict(lb_loss_weight=0.3, z_loss_weight=0.05)
CASES = {
    # OLMo-core 3's shape: softmax + shared expert + QK-norm, both layers MoE
    "softmax_shared": dict(qk_norm=True, shared_expert_hidden=24, router=dict(top_k=2, **WEIGHTS)),
    # sigmoid (normalised per token in lb), selection bias, routed scaling, gated shared expert, a dense layer
    "sigmoid_gated": dict(shared_expert_hidden=20, shared_expert_gate=True, tie_embeddings=True, num_layers=3,
                          dense_layers=[1], router=dict(gating="sigmoid", top_k=2, expert_bias=True,
                                                        routed_scaling_factor=2.5, **WEIGHTS)),
    "dense": dict(num_experts=0, router=dict(routing="random")),  # the router section of a dense model is unused
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case -> (our model, transformers' fp32 model of its custom-code export, the folder); each exported once."""
    made: dict[str, tuple[Transformer, torch.nn.Module, Path]] = {}

    def get(case: str):
        if case not in made:
            model = random_model(BASE, CASES[case], seed=5)
            out = tmp_path_factory.mktemp("hf") / case
            export_hf(model, out, dtype="fp32", custom_code=True)
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                  trust_remote_code=True).eval()
            made[case] = model, hf, out
        return made[case]

    return get


def tokens(rows: int, seq: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(seed))


def our_loss(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe-train's (ce, aux) on ids scored as transformers' labels=ids score them (the last position no target)."""
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return model.loss(ids, targets)


@pytest.mark.parametrize("case", ["softmax_shared", "sigmoid_gated"])
def test_labels_loss_with_router_logits_is_our_ce_plus_aux_with_the_same_gradients(case, exported):
    model, hf, _ = exported(case)
    ids = tokens(2)
    model.zero_grad()
    ce, aux = our_loss(model, ids)
    (ce + aux).backward()  # the trainer's micro-batch loss at grad_accum 1
    assert aux.item() > 0.05  # the term being checked is not negligible
    hf.zero_grad()
    out = hf(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    assert abs(out.loss.item() - (ce + aux).item()) < 2e-6
    assert abs(out.aux_loss.item() - aux.item()) < 1e-6
    moe_layers = [i for i in range(model.cfg.num_layers) if model.cfg.is_moe_layer(i)]
    assert len(out.router_logits) == len(moe_layers)
    assert all(t.shape == (ids.numel(), model.cfg.num_experts) and t.dtype == torch.float32 for t in out.router_logits)
    theirs = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        g = theirs[name if name == "lm_head.weight" else f"model.{name}"].grad
        assert g is not None, name
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

    # gradient checkpointing recomputes each block in backward: the same loss and router gradient
    hf.zero_grad()
    hf.gradient_checkpointing_enable()
    try:
        hf.train()(ids, labels=ids, output_router_logits=True).loss.backward()
    finally:
        hf.gradient_checkpointing_disable()
        hf.eval()
    router = f"blocks.{moe_layers[0]}.mlp.router.weight"
    torch.testing.assert_close(theirs[f"model.{router}"].grad, model.get_parameter(router).grad, rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_with_num_items_in_batch_weighs_the_aux_once_per_step(exported):
    """transformers' Trainer under gradient_accumulation_steps=G passes num_items_in_batch (the targets of all G
    micro-batches) and sums the G losses' gradients: with the aux weighted by each micro-batch's share of the targets,
    that sum is moe-train's step, the mean of (CE + aux) over G equal micro-batches, loss and every gradient (it was
    CE/G + aux: the aux G times over). A micro-batch with fewer targets weighs its aux less."""
    model, hf, _ = exported("softmax_shared")
    batches = [tokens(2, seed=s) for s in (1, 2, 3)]
    model.zero_grad()
    ours = sum(sum(our_loss(model, ids)) for ids in batches) / len(batches)
    ours.backward()
    items = sum(ids[:, 1:].numel() for ids in batches)
    hf.zero_grad()
    theirs = 0.0
    for ids in batches:
        loss = hf(ids, labels=ids, output_router_logits=True, num_items_in_batch=torch.tensor(items)).loss
        loss.backward()
        theirs += loss.item()
    assert abs(theirs - ours.item()) < 2e-6, (theirs, ours.item())
    params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        g = params[name if name == "lm_head.weight" else f"model.{name}"].grad
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    ids = batches[0]
    labels = ids.clone()
    labels[0] = -100  # half of this micro-batch's targets ignored: its aux weighs n / N with the n left
    with torch.no_grad():
        out = hf(ids, labels=labels, output_router_logits=True, num_items_in_batch=items)
        ce = hf(ids, labels=labels, num_items_in_batch=items).loss
    n = int((labels[:, 1:] != -100).sum())
    assert abs(out.loss.item() - (ce.item() + out.aux_loss.item() * n / items)) < 1e-6


def test_output_router_logits_is_off_by_default_and_off_gives_the_cross_entropy_alone(exported):
    model, hf, out = exported("softmax_shared")
    assert json.loads((out / "config.json").read_text())["output_router_logits"] is False
    ids = tokens(2)
    with torch.no_grad():
        default = hf(ids, labels=ids)
        logits = default.logits
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        assert type(default).__name__ == "CausalLMOutputWithPast" and torch.equal(default.loss, ce)
        hf.config.output_router_logits = True  # the config turns it on, forward's argument overrides the config
        try:
            on, off = hf(ids, labels=ids), hf(ids, labels=ids, output_router_logits=False)
        finally:
            hf.config.output_router_logits = False
    assert torch.equal(off.loss, default.loss) and torch.equal(off.logits, default.logits)
    assert getattr(off, "aux_loss", None) is None and getattr(off, "router_logits", None) is None
    assert torch.equal(on.loss, default.loss + on.aux_loss) and on.aux_loss.item() > 0.05


def test_padded_rows_stay_out_of_the_router_statistics(exported):
    """A third row all padding (attention_mask 0, labels -100): loss and aux are ours on the two real rows; an
    all-ones mask gives what no mask gives."""
    model, hf, _ = exported("sigmoid_gated")
    ids = tokens(2)
    padded = torch.cat([ids, tokens(1, seed=9)])
    mask = torch.ones_like(padded)
    mask[2] = 0
    labels = padded.clone()
    labels[2] = -100
    with torch.no_grad():
        ce, aux = our_loss(model, ids)
        out = hf(padded, attention_mask=mask, labels=labels, output_router_logits=True)
        plain = hf(ids, output_router_logits=True)
        ones = hf(ids, attention_mask=torch.ones_like(ids), output_router_logits=True)
    assert abs(out.aux_loss.item() - aux.item()) < 1e-6 and abs(out.loss.item() - (ce + aux).item()) < 2e-6
    assert torch.equal(ones.aux_loss, plain.aux_loss) and abs(plain.aux_loss.item() - aux.item()) < 1e-6


def test_dense_model_labels_loss_with_router_logits_has_a_zero_aux(exported, tmp_path):
    model, hf, out = exported("dense")
    ids = tokens(2)
    with torch.no_grad():
        ce, aux = our_loss(model, ids)
        result = hf(ids, labels=ids, output_router_logits=True)
    assert result.router_logits == () and result.aux_loss.item() == 0.0 == aux.item()
    assert abs(result.loss.item() - ce.item()) < 2e-6
    cfg, _ = import_hf(out, tmp_path / "imported")  # the unused router section's routing is not refused
    assert cfg.model == model.cfg


def test_import_refuses_a_routing_other_than_learned(exported, tmp_path):
    _, _, out = exported("softmax_shared")
    config = json.loads((out / "config.json").read_text())
    assert config["moe_train_model"]["router"]["routing"] == "learned"
    for routing in ("random", "uniform"):
        folder = tmp_path / routing
        folder.mkdir()
        for f in out.iterdir():
            if f.is_file():
                (folder / f.name).write_bytes(f.read_bytes())
        config["moe_train_model"]["router"]["routing"] = routing
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(HFConversionError, match=f"router.routing='{routing}': expected 'learned'"):
            import_hf(folder, tmp_path / f"{routing}_imported")
        assert not (tmp_path / f"{routing}_imported").exists()
