"""QA 118: the custom-code HF export under transformers' real Trainer with gradient accumulation. One SGD step of
Trainer (CPU, fp32, sequential sampler, constant lr, no weight decay, warmup or clipping) over G micro-batches with
output_router_logits set in the config moves every parameter as moe-train's step does: the gradient of the mean of
(CE + aux) over G equal micro-batches (before moe-ckpt 0.18.0 the aux came G times over); micro-batches with
unequal target counts weigh each aux by its share of the step's targets. Then the forward's num_items_in_batch edges:
an int or a tensor of any integer or float dtype, a micro-batch without targets, labels=None, return_dict=False.

Our model (test_hf_aux_loss's softmax_shared, aux weights far above the defaults) computes the hand step; its
custom-code export is what Trainer trains. transformers' caches stay in a temporary folder (hf_home). Trainer needs
accelerate, which the workspace's dev group locks for these tests."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_train.hf_bridge import export_hf

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_home, one_thread, random_model  # noqa: E402,F401 - fixtures
from test_hf_aux_loss import BASE, CASES  # noqa: E402

LR = 0.5  # SGD: a parameter's delta is -LR * its gradient, so a misweighted aux shows undamped (Adam's would not)
ROWS, SEQ = 2, 10  # rows per micro-batch, tokens per row


@pytest.fixture(scope="module")
def exported(request, tmp_path_factory):
    request.getfixturevalue("hf_home")  # transformers' caches in a temporary folder, before anything loads
    model = random_model(BASE, CASES["softmax_shared"], seed=5)
    out = tmp_path_factory.mktemp("qa118") / "hf"
    export_hf(model, out, dtype="fp32", custom_code=True)
    return model, out


def load(folder: Path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, trust_remote_code=True)
    hf.config.output_router_logits = True  # as a user turns the aux on for Trainer, which passes no such argument
    return hf


def rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, BASE["vocab_size"], (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def micro_batches(data: list[dict], g: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The sequential sampler's micro-batches: (input_ids, labels), each [ROWS, SEQ]."""
    chunks = [data[i * ROWS:(i + 1) * ROWS] for i in range(g)]
    return [(torch.stack([r["input_ids"] for r in c]), torch.stack([r["labels"] for r in c])) for c in chunks]


def trainer_step(folder: Path, data: list[dict], g: int, tmp_path: Path):
    """One optimizer step of transformers.Trainer -> (delta of every parameter by HF name, the forwards' kwargs,
    Trainer's first log, the trainer)."""
    hf = load(folder)
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    seen: list[dict] = []
    hf.register_forward_pre_hook(lambda mod, args, kw: seen.append(dict(kw)), with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=ROWS, gradient_accumulation_steps=g, max_steps=1,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=hf, args=args, train_dataset=data)
    trainer.train()
    after = dict(hf.named_parameters())
    deltas = {n: (after[n].detach() - p) for n, p in before.items()}
    return deltas, seen, trainer.state.log_history[0], trainer


def hand_step(model, batches, ce_weights: list[float], aux_weights: list[float]) -> tuple[dict, float]:
    """Our model's gradient of sum_i (ce_weights[i] * CE_i + aux_weights[i] * aux_i), CE_i the mean over micro-batch
    i's targets, by HF parameter name, and that loss."""
    params = dict(model.named_parameters())
    loss = 0.0
    for (ids, labels), wc, wa in zip(batches, ce_weights, aux_weights):
        # labels [B, S] as transformers takes them -> moe-train's targets, the last position none
        ce, aux = model.loss(ids, torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1))
        loss = loss + wc * ce + wa * aux
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return ({n if n == "lm_head.weight" else f"model.{n}": torch.zeros_like(params[n]) if g is None else g
             for n, g in zip(params, grads)}, loss.item())


def aux_alone(model, batches) -> float:
    with torch.no_grad():
        return sum(model(ids)[1].item() for ids, _ in batches) / len(batches)


def max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def check_step(deltas: dict, grads: dict, pre_fix: dict) -> tuple[float, float]:
    """Trainer's deltas are -LR * grads to fp32 tolerance -> (their max difference, how far the pre-fix step's
    deltas -LR * pre_fix lie from them)."""
    assert deltas.keys() == grads.keys()
    ours = {n: -LR * g for n, g in grads.items()}
    for n in ours:
        # deltas of O(0.1) parameters: their fp32 ulp (~1e-8) and the gradients' 1e-4 relative agreement
        torch.testing.assert_close(deltas[n], ours[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    return max_diff(deltas, ours), max_diff(ours, {n: -LR * g for n, g in pre_fix.items()})


@pytest.mark.parametrize("g", [1, 3])
def test_trainer_step_under_gradient_accumulation_is_moe_trains_mean_of_ce_plus_aux(exported, tmp_path, g):
    """G micro-batches of equal target counts: Trainer's SGD step is -lr * grad of mean_i (CE_i + aux_i), moe-train's
    step; its logged loss is that mean too. G=1 is the control (no accumulation: the same before and after the fix);
    at G=3 the pre-fix step (CE_i / G + aux_i per micro-batch) lies far outside the tolerance."""
    model, folder = exported
    data = rows(ROWS * g, seed=11)
    deltas, seen, log, trainer = trainer_step(folder, data, g, tmp_path)
    batches = micro_batches(data, g)
    assert trainer.model_accepts_loss_kwargs  # so Trainer passes num_items_in_batch and does not divide by G
    assert type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)) is torch.optim.SGD
    assert log["learning_rate"] == LR
    assert len(seen) == g and all(torch.equal(kw["input_ids"], ids) for kw, (ids, _) in zip(seen, batches))
    assert all(float(kw["num_items_in_batch"]) == g * ROWS * (SEQ - 1) for kw in seen)  # the step's shifted targets

    grads, loss = hand_step(model, batches, [1 / g] * g, [1 / g] * g)
    pre_fix, _ = hand_step(model, batches, [1 / g] * g, [1.0] * g)
    aux = aux_alone(model, batches)
    assert aux > 0.05  # the term being weighed is not negligible
    diff, gap = check_step(deltas, grads, pre_fix)
    print(f"G={g}: max |delta_trainer - delta_hand| = {diff:.3g}; pre-fix step {gap:.3g} away; "
          f"Trainer's loss {log['loss']:.7f}, mean(CE + aux) {loss:.7f} (mean aux {aux:.7f})")
    if g > 1:
        assert gap > 1000 * 1e-6, gap
    # Trainer logs the sum of the G micro-batch losses it backpropagated: here mean_i (CE_i + aux_i)
    assert abs(log["loss"] - loss) < 1e-5, (log["loss"], loss)


def test_trainer_step_with_unequal_micro_batches_weighs_each_aux_by_its_share_of_the_targets(exported, tmp_path):
    """Two micro-batches, the first with one of its rows' labels all -100 (n_0 = 9 of N = 27 targets): the step is
    -lr * grad sum_i [CE_sum_i / N + aux_i * n_i / N], the token-weighted aux (not the mean of the auxes, which
    moe-train's batches, without ignored targets, never tell apart; nor the pre-fix sum of the auxes)."""
    model, folder = exported
    data = rows(2 * ROWS, seed=12)
    data[0]["labels"] = torch.full_like(data[0]["labels"], -100)
    deltas, seen, log, _ = trainer_step(folder, data, 2, tmp_path)
    batches = micro_batches(data, 2)
    counts = [int((labels[:, 1:] != -100).sum()) for _, labels in batches]
    total = sum(counts)
    assert counts == [SEQ - 1, ROWS * (SEQ - 1)] and all(float(kw["num_items_in_batch"]) == total for kw in seen)

    share = [c / total for c in counts]  # CE_sum_i / N = CE_mean_i * n_i / N
    grads, loss = hand_step(model, batches, share, share)
    pre_fix, _ = hand_step(model, batches, share, [1.0, 1.0])
    mean_aux, _ = hand_step(model, batches, share, [0.5, 0.5])
    diff, gap = check_step(deltas, grads, pre_fix)
    print(f"unequal: max |delta_trainer - delta_hand| = {diff:.3g}; pre-fix step {gap:.3g} away, mean-of-aux step "
          f"{max_diff(grads, mean_aux) * LR:.3g} away; Trainer's loss {log['loss']:.7f}, "
          f"sum_i [CE_sum_i + aux_i n_i] / N {loss:.7f}")
    assert gap > 1000 * 1e-6, gap
    assert abs(log["loss"] - loss) < 1e-5, (log["loss"], loss)


@pytest.fixture(scope="module")
def hf(exported):
    return load(exported[1]).eval()


def test_num_items_in_batch_as_an_int_or_a_tensor_of_any_integer_or_float_dtype_gives_the_same_loss(hf):
    """Trainer passes a float32 tensor (its count divided by tp * cp * sp sizes); a user may pass an int or an
    int32/int64 tensor, 0-d or of shape [1]: the same CE_sum / N + aux * n / N each time."""
    (ids, labels), = micro_batches(rows(ROWS, seed=13), 1)
    labels[0, :4] = -100
    n, items = int((labels[:, 1:] != -100).sum()), 40
    with torch.no_grad():
        ref = hf(ids, labels=labels, num_items_in_batch=items)
        ce_sum = hf(ids, labels=labels, output_router_logits=False).loss * n
    assert abs(ref.loss.item() - (ce_sum.item() / items + ref.aux_loss.item() * n / items)) < 1e-6
    for form in [torch.tensor(items), torch.tensor(items, dtype=torch.int32), torch.tensor(float(items)),
                 torch.tensor(items, dtype=torch.float64), torch.tensor([items]), float(items)]:
        with torch.no_grad():
            loss = hf(ids, labels=labels, num_items_in_batch=form).loss
        # a float64 count makes a float64 loss (0-d / 0-d promotes), as transformers' own ForCausalLMLoss does
        assert loss.dtype == (torch.float64 if getattr(form, "dtype", None) == torch.float64 else torch.float32)
        assert abs(loss.item() - ref.loss.item()) < 1e-6, (form, loss.item(), ref.loss.item())


def test_a_micro_batch_without_targets_adds_no_aux_and_no_nan(hf):
    """All labels -100 (a prompt-only micro-batch) with the step's N > 0: loss 0, aux weight 0, finite zero
    gradients; the aux itself is still reported."""
    (ids, labels), = micro_batches(rows(ROWS, seed=14), 1)
    labels[:] = -100
    hf.zero_grad()
    out = hf(ids, labels=labels, num_items_in_batch=torch.tensor(27.0))
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.aux_loss.item() > 0.05
    grads = [p.grad for p in hf.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)
    hf.zero_grad()


def test_labels_none_with_num_items_in_batch_gives_no_loss_and_the_aux(hf):
    (ids, _), = micro_batches(rows(ROWS, seed=15), 1)
    with torch.no_grad():
        out = hf(ids, num_items_in_batch=torch.tensor(18))
        plain = hf(ids)
    assert out.loss is None and math.isfinite(out.aux_loss.item()) and out.aux_loss.item() > 0.05
    assert torch.equal(out.logits, plain.logits) and torch.equal(out.aux_loss, plain.aux_loss)


def test_return_dict_false_gives_the_weighted_loss_first(hf):
    (ids, labels), = micro_batches(rows(ROWS, seed=16), 1)
    with torch.no_grad():
        as_dict = hf(ids, labels=labels, num_items_in_batch=54)
        as_tuple = hf(ids, labels=labels, num_items_in_batch=54, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], as_dict.loss)
    assert any(isinstance(t, torch.Tensor) and t.ndim == 0 and torch.equal(t, as_dict.aux_loss) for t in as_tuple[1:])
