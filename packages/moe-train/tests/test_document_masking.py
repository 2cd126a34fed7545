"""train.document_masking: attention within documents (the data folder's eos_id ends each).

The central check: with the mask, a document packed into a window after other documents gives the logits it gives
alone at the start of a window (rotary attention depends on offsets only, and routing is per token, dropless)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from moe_train.config import ConfigError, ModelConfig, RouterConfig, validate
from moe_train.config_io import config_from_dict
from moe_train.model.transformer import Transformer, document_attention_mask
from moe_train.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402

EOS = 3


def _model(dtype: torch.dtype = torch.float64, **changes) -> Transformer:
    fields = dict(vocab_size=61, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, qk_norm=True, dense_hidden=48,
                  dense_layers=[0], num_experts=5, expert_hidden=16, shared_expert_hidden=8,
                  router=RouterConfig(top_k=2))
    cfg = ModelConfig(**(fields | changes))
    torch.manual_seed(0)
    return Transformer(cfg).to(dtype)


def _tokens(n: int, g: torch.Generator) -> torch.Tensor:
    t = torch.randint(0, 61, (n,), generator=g)
    t[t == EOS] = EOS + 1  # no stray document end inside a document
    return t


def test_the_mask_keeps_each_token_to_the_earlier_tokens_of_its_document():
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, EOS, 9], [5, 6, 7, 8, 9, 10, 11]])
    mask = document_attention_mask(tokens, EOS)
    assert mask.shape == (2, 1, 7, 7) and mask.dtype == torch.bool
    # documents of row 0: [5, EOS], [7, 8, EOS], [EOS], [9] (an eos ends its document, the next token starts one)
    documents = [0, 0, 1, 1, 1, 2, 3]
    want = torch.tensor([[j <= i and documents[i] == documents[j] for j in range(7)] for i in range(7)])
    assert torch.equal(mask[0, 0], want)
    assert torch.equal(mask[1, 0], torch.ones(7, 7, dtype=torch.bool).tril())  # no eos: causal


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_a_packed_document_reads_as_it_does_alone(dtype, tol):
    g = torch.Generator().manual_seed(1)
    first, second, third = _tokens(9, g), _tokens(13, g), _tokens(6, g)
    eos = torch.tensor([EOS])
    packed = torch.cat([first, eos, second, eos, third]).unsqueeze(0)  # 30 tokens, the second document at 10
    alone = torch.cat([second, eos]).unsqueeze(0)
    model = _model(dtype)
    model.set_document_masking(EOS)
    with torch.no_grad():
        got = model(packed)[0][0, 10:24]
        want = model(alone)[0][0]
        head = model(first.unsqueeze(0))[0][0]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(model(packed)[0][0, :9].detach(), head, rtol=tol, atol=tol)  # the first: causal
    model.set_document_masking(None)  # without the mask the packed document sees the one before it
    with torch.no_grad():
        assert not torch.allclose(model(packed)[0][0, 10:24], want, rtol=1e-3, atol=1e-3)


def test_gradients_stay_within_a_document():
    """The loss of the second document alone: no gradient reaches the first document's embeddings through attention."""
    g = torch.Generator().manual_seed(2)
    packed = torch.cat([_tokens(7, g), torch.tensor([EOS]), _tokens(8, g)]).unsqueeze(0)
    model = _model()
    model.set_document_masking(EOS)
    x = model.embed(packed).detach().requires_grad_()
    seen = {}
    model.embed.register_forward_hook(lambda mod, inp, out: x)
    logits, _ = model(packed)
    logits[0, 8:].sum().backward()
    seen["first"], seen["second"] = x.grad[0, :8].abs().max().item(), x.grad[0, 8:].abs().max().item()
    assert seen["first"] == 0 and seen["second"] > 0, seen


@pytest.mark.parametrize("mode", ["full", "mlp"])
def test_activation_checkpointing_recomputes_with_the_same_mask(mode):
    g = torch.Generator().manual_seed(3)
    tokens = torch.stack([torch.cat([_tokens(5, g), torch.tensor([EOS]), _tokens(10, g)]) for _ in range(2)])
    model = _model()
    model.set_document_masking(EOS)
    grads = {}
    for recompute in ("none", mode):
        model.set_activation_checkpointing(recompute)
        model.zero_grad()
        sum(model.loss_terms(tokens[:, :-1], tokens[:, 1:])).backward()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for n, want in grads["none"].items():
        torch.testing.assert_close(grads[mode][n], want, rtol=1e-10, atol=1e-12, msg=n)


def test_bad_ids_are_refused_and_copies_keep_the_setting():
    model = _model()
    for bad in (-1, 61, True, 2.0):
        with pytest.raises(ValueError, match=r"eos_id=.*expected a token id in \[0, model.vocab_size=61\)"):
            model.set_document_masking(bad)
    model.set_document_masking(EOS)
    import copy
    import pickle
    assert copy.deepcopy(model).document_eos_id == EOS
    assert pickle.loads(pickle.dumps(model)).document_eos_id == EOS
    with pytest.raises(ConfigError, match="train.document_masking"):
        validate(config_from_dict({"train": {"document_masking": "yes please"}}))


def _metrics(run_dir: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" not in r]


def test_the_trainer_masks_with_its_data_eos_id_in_training_and_eval(tmp_path, _prepared_data):
    """Short documents (a few per 32-token window): the trainer hands the model its data's eos_id, and the masked
    run's losses differ from the causal one's from its first eval on."""
    from moe_train.data import prepare_data, stdlib_documents

    text = "".join(stdlib_documents(60_000))
    docs = [text[i:i + 20 + i % 30] for i in range(0, 40_000, 97)]  # ~400 documents of 20-49 characters
    data = prepare_data(docs, tmp_path / "data", vocab_size=512, source="short-documents")
    meta = json.loads((Path(data) / "meta.json").read_text())

    def run(name: str, masking: bool) -> tuple[list[dict], Trainer]:
        cfg = small_config(tmp_path / name, steps=3, eval_interval=3, save_interval=0, document_masking=masking)
        cfg.data.path = str(data)
        with Trainer(cfg) as trainer:
            assert trainer.model.document_eos_id == (meta["eos_id"] if masking else None)
            trainer.train()
            x, _ = trainer.sampler.next_batch(8, 0, 1)
        return _metrics(cfg.train.run_dir), x

    masked, windows = run("masked", True)
    plain, _ = run("plain", False)
    assert (windows == meta["eos_id"]).any(dim=1).sum() >= 6  # most windows cross a document boundary
    losses = [[r["loss"] for r in recs if "loss" in r] for recs in (masked, plain)]
    evals = [[r["eval_loss"] for r in recs if "eval_loss" in r] for recs in (masked, plain)]
    assert all(v > 0 for v in losses[0] + evals[0])
    assert len(evals[0]) == 2 and abs(evals[0][0] - evals[1][0]) > 1e-4, evals  # step 0: the same weights



def test_a_data_folder_whose_eos_id_is_outside_its_vocabulary_is_refused_naming_it(data_dir, tmp_path):
    from moe_train.data.token_file import DataError, open_data

    meta_path = data_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["eos_id"] = meta["vocab_size"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"meta.json: eos_id={meta['vocab_size']}, expected an id below its vocab_size"):
        open_data(data_dir, 4096)
