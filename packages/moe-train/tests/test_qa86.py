"""QA of the custom-code Hugging Face export as a transformers user meets it: fine-tuning with transformers' Trainer
(num_items_in_batch, gradient checkpointing, bf16 autocast), hidden states, a resized vocabulary saved and loaded
again, generate with a static cache, and import of a config.json whose moe_train_model lacks a field. One tiny fp32
model of OLMo-core 3's shape with a selection bias (test_hf_custom_code's), exported once; transformers' module cache
in a temporary folder (its hf_home)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moe_ckpt.hf import HFConversionError
from moe_train.hf_bridge import export_hf, import_hf

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_home, one_thread, our_greedy, transformers  # noqa: E402,F401 - fixtures
from test_hf_custom_code import REFUSED_BY_STOCK, make_model  # noqa: E402

OLMO3 = REFUSED_BY_STOCK["olmo3"][0]
OVERRIDES = {**OLMO3, "router": {**OLMO3["router"], "expert_bias": True}}


@pytest.fixture(scope="module")
def exported(request, tmp_path_factory):
    request.getfixturevalue("hf_home")  # transformers' caches in a temporary folder, before anything loads
    model = make_model(OVERRIDES)
    out = tmp_path_factory.mktemp("qa86") / "hf"
    export_hf(model, out, dtype="fp32", custom_code=True)
    return model, out


def load(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, trust_remote_code=True)


@pytest.fixture(scope="module")
def loaded(exported):
    return load(exported[1]).eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def test_labels_loss_is_the_sum_over_num_items_in_batch_as_transformers_trainer_passes_it(exported, loaded):
    """The Trainer passes num_items_in_batch (the targets of all micro-batches of an optimizer step) to a forward that
    takes **kwargs and then does not divide the loss by the gradient accumulation steps: a mean here made every update
    under gradient_accumulation_steps=N N times too large (checked with Trainer: 2x at N=2, train_loss doubled)."""
    model, _ = exported
    ids = tokens(model.cfg.vocab_size)
    labels = ids.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        ours, _ = model.loss(ids[:, :-1], labels[:, 1:])  # the mean over the 18 targets
        mean = loaded(ids, labels=labels).loss
        step = loaded(ids, labels=labels, num_items_in_batch=torch.tensor(3 * 18)).loss  # 3 micro-batches
    assert (labels[:, 1:] != -100).sum() == 18
    # fp32 sums of 18 terms of ~5: a few ulp of 5 (~1e-6)
    assert abs(mean.item() - ours.item()) < 1e-5, (mean.item(), ours.item())
    assert abs(step.item() - ours.item() / 3) < 1e-5, (step.item(), ours.item() / 3)


def test_gradient_checkpointing_gives_our_gradients(exported, loaded):
    """gradient_checkpointing_enable() (was: "does not support activation checkpointing"): each block recomputed in
    backward, no cache written, the gradients of every parameter those of our model on the same loss."""
    model, _ = exported
    ids = tokens(model.cfg.vocab_size)
    model.zero_grad()
    model.loss(ids[:, :-1], ids[:, 1:])[0].backward()
    loaded.gradient_checkpointing_enable()
    try:
        loaded.train().zero_grad()
        out = loaded(ids, labels=ids)
        out.loss.backward()
    finally:
        loaded.gradient_checkpointing_disable()
        loaded.eval()
    assert loaded.model.gradient_checkpointing is False and out.loss.grad_fn is not None
    theirs = dict(loaded.named_parameters())
    for name, p in model.named_parameters():
        g = theirs[name if name == "lm_head.weight" else f"model.{name}"].grad
        # fp32 gradients of O(1) sums over 24 tokens: 3.6e-7 apart here; 1e-5 is ~100 ulp of their scale
        assert (g - p.grad).abs().max().item() < 1e-5, name


def test_output_hidden_states_are_our_block_outputs_and_output_attentions_is_refused(exported, loaded):
    """output_hidden_states=True was ignored (hidden_states None): now the embeddings, each block's output and the
    last after the final norm, as transformers' models give them; output_attentions=True (SDPA has no weights) was
    ignored too and is refused naming it."""
    model, _ = exported
    ids = tokens(model.cfg.vocab_size)
    blocks = []
    hooks = [b.register_forward_hook(lambda mod, args, out: blocks.append(out[0])) for b in model.blocks]
    try:
        with torch.no_grad():
            logits = model(ids)[0]
            out = loaded(ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    states = out.hidden_states
    assert states is not None and len(states) == model.cfg.num_layers + 1
    assert torch.equal(states[0], model.embed(ids))
    for mine, theirs in zip(blocks[:-1], states[1:-1]):
        assert (mine - theirs).abs().max().item() < 1e-5
    assert (model.norm(blocks[-1]) - states[-1]).abs().max().item() < 1e-5
    assert (loaded.lm_head(states[-1]) - logits).abs().max().item() < 1e-4  # the logits' tolerance in test_hf_custom_code
    with pytest.raises(ValueError, match="output_attentions=True"):
        loaded(ids, output_attentions=True)


def test_resized_token_embeddings_save_load_and_import_again(exported, tmp_path):
    """resize_token_embeddings (adding a pad token) changed config.vocab_size but not moe_train_model's, which the
    modeling file builds from: save_pretrained wrote a folder transformers refused to load (size mismatch) and import
    refused (vocab_size disagrees)."""
    model, out = exported
    hf = load(out).eval()
    hf.resize_token_embeddings(model.cfg.vocab_size + 3, mean_resizing=False)
    assert hf.config.moe_train_model["vocab_size"] == model.cfg.vocab_size + 3
    hf.save_pretrained(tmp_path / "resized")
    ids = tokens(model.cfg.vocab_size + 3)
    with torch.no_grad():
        before, after = hf(ids).logits, load(tmp_path / "resized").eval()(ids).logits
    assert after.shape[-1] == model.cfg.vocab_size + 3 and torch.equal(before, after)
    cfg, state = import_hf(tmp_path / "resized")
    assert cfg.model.vocab_size == model.cfg.vocab_size + 3
    assert torch.equal(state["embed.weight"], hf.model.embed.weight.detach())


@pytest.mark.parametrize("field", ["expert_hidden", "router.normalize_top_k"])
def test_import_refuses_a_moe_train_model_without_a_field_naming_it(exported, tmp_path, field):
    """Was a bare KeyError ('expert_hidden'), or silently the default (normalize_top_k=True, whatever the tensors were
    trained with; the modeling file fails on it)."""
    _, out = exported
    folder = tmp_path / "tampered"
    shutil.copytree(out, folder)
    config = json.loads((folder / "config.json").read_text())
    m = config["moe_train_model"]
    (m["router"] if field.startswith("router.") else m).pop(field.removeprefix("router."))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConversionError, match=rf"moe_train_model has no {field}\b"):
        import_hf(folder)


def test_router_logits_and_combine_stay_fp32_under_autocast_as_ours(exported, loaded):
    """Trainer(bf16=True) runs the forward under torch.autocast: the router logits were bf16 (other experts chosen
    for near-ties: 41 of these 8,192 rows, the layer's output 0.41 off ours) and the combine summed in bf16.
    Our router keeps fp32 under autocast; on the same rows both now choose the same experts with the same fp32
    weights, and the layer outputs differ only by the bf16 rounding of the expert GEMMs."""
    model, _ = exported
    theirs, ours = loaded.model.blocks[1].mlp, model.blocks[1].mlp
    rows = torch.randn(8192, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ids, weights = theirs.route(rows)
        routed = ours.router(rows)
        out_theirs, out_ours = theirs(rows), ours(rows)[0]
    assert weights.dtype == torch.float32 and torch.equal(ids, routed.expert_ids)
    assert (weights - routed.weights).abs().max().item() < 1e-6
    # outputs up to ~1.3 (bf16 ulp 0.008): 0.004 apart here, the expert GEMMs' bf16 rounding; a changed expert: 0.41
    assert (out_theirs.float() - out_ours.float()).abs().max().item() < 0.02


def test_generate_with_a_static_cache_decodes_left_padded_rows_as_ours(exported, loaded):
    """generate(cache_implementation="static") (torch.compile'd generation's cache) failed with a shape error: a static
    cache gives keys for all its slots, and generate then asks the model for a 4-D mask, which forward refuses. Rows
    of 12 and 8 tokens (4 pads) now decode greedily as ours."""
    model, _ = exported
    ids = tokens(model.cfg.vocab_size)
    short = ids[1:, :8]
    batch = torch.cat([ids[:1], torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    with torch.no_grad():
        out = loaded.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              cache_implementation="static")
    assert torch.equal(out[0], our_greedy(model, ids[:1], 6)[0])
    assert torch.equal(out[1, 4:], our_greedy(model, short, 6)[0])
