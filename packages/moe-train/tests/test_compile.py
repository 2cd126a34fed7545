"""train.compile: torch.compile of each block's attention, norms and dense SwiGLU, the final norm and the loss's
cross-entropy (the MoE layers stay eager) changes how the step runs, not what it computes.

On the CPU (inductor's C++ backend), fp32: the compiled model gives eager's loss, router loss and every gradient
to fp32 rounding, for GQA with QK-norm, partial rotary, attention biases, a dense first layer and a shared
expert; one graph per kind of module, whatever the depth (no recompilation per layer, no graph break); the
state_dict keys are the eager model's, and set_compile(False) is eager again. Through the Trainer (LocalRuntime
hands the setting to the model) and the CLI: the same losses as eager and the same checkpoint names. Refused
with the FSDP2 baseline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).parent))
from conftest import small_config  # noqa: E402

from moe_ckpt import load_checkpoint, step_dir  # noqa: E402
from moe_train.cli import main  # noqa: E402
from moe_train.config import Config, ConfigError, ModelConfig, RouterConfig, TrainConfig, validate  # noqa: E402
from moe_train.model import Transformer  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402

VOCAB, SEQ, BATCH = 512, 32, 4  # the data_dir fixture's vocabulary, small_config's windows


def model_config(num_layers: int = 3) -> ModelConfig:
    """The first layer dense, the rest MoE with a shared expert; GQA, QK-norm, half the head dims rotated."""
    return ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=num_layers, num_heads=4, num_kv_heads=2, qk_norm=True,
                       attention_bias=True, rotary_fraction=0.5, dense_hidden=48, dense_layers=[0], num_experts=4,
                       expert_hidden=24, shared_expert_hidden=16, router=RouterConfig(top_k=2))


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: Transformer, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    ce, aux = model.loss(batch[:, :-1], batch[:, 1:].contiguous())  # contiguous targets, as the trainer's
    (ce + aux).backward()
    return ce.detach(), aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def eager_and_compiled():
    torch.manual_seed(0)
    eager = Transformer(model_config())
    compiled = Transformer(model_config())
    compiled.load_state_dict(eager.state_dict())
    compiled.set_compile(True)
    return eager, compiled


def test_compiled_model_gives_eager_losses_and_every_gradient(eager_and_compiled):
    eager, compiled = eager_and_compiled
    for seed in (1, 2):  # the second call runs the compiled graphs without compiling
        batch = tokens(seed)
        want, got = loss_and_grads(eager, batch), loss_and_grads(compiled, batch)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        assert set(got[2]) == set(want[2])
        for name, g in want[2].items():
            scale = g.abs().max().item() + 1e-12
            assert (got[2][name] - g).abs().max().item() <= 1e-4 * scale, name


def test_the_compiled_model_keeps_its_state_dict_and_set_compile_false_is_eager_again(eager_and_compiled):
    eager, compiled = eager_and_compiled
    assert list(compiled.state_dict()) == list(eager.state_dict())
    compiled.set_compile(False)
    try:
        assert not compiled.compiled
        assert all(m._compiled_call_impl is None for m in compiled.modules())
        batch = tokens(3)
        want, got = loss_and_grads(eager, batch), loss_and_grads(compiled, batch)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # eager twice: bit for bit
    finally:
        compiled.set_compile(True)


def test_trainer_with_compile_trains_the_eager_steps_into_the_same_checkpoint(tmp_path, data_dir):
    """Three steps through the Trainer eager, and through `moe-train train --train.compile=true`: the same logged
    losses (fp32, to rounding) and a checkpoint under the same names, close in value."""
    def run(name: str, compile_: bool) -> list[float]:
        cfg = small_config(tmp_path / name, steps=3, save_interval=3, eval_interval=0, warmup_steps=1, log_interval=1)
        cfg.data.path = str(data_dir)
        cfg.model = model_config()  # the shapes the tests above compiled: their graphs serve this run too
        if compile_:
            stored = cfg.to_dict()
            stored.pop("preset")
            (tmp_path / "c.yaml").write_text(yaml.safe_dump(stored))
            assert main(["train", "--config", str(tmp_path / "c.yaml"), "--train.compile=true"]) == 0
        else:
            Trainer(cfg).train()
        log = Path(cfg.train.run_dir) / "metrics.jsonl"
        return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]

    want, got = run("eager", False), run("compiled", True)
    assert len(want) == len(got) == 3
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-4 * abs(b), (got, want)
    eager_ckpt = load_checkpoint(step_dir(tmp_path / "eager" / "run" / "checkpoints", 3))
    compiled_ckpt = load_checkpoint(step_dir(tmp_path / "compiled" / "run" / "checkpoints", 3))
    assert set(compiled_ckpt) == set(eager_ckpt)
    for name, v in eager_ckpt.items():
        if v.is_floating_point():
            torch.testing.assert_close(compiled_ckpt[name], v, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_compile_with_the_fsdp_baseline_is_refused_naming_both_fields():
    cfg = Config(model=model_config(), train=TrainConfig(compile=True, save_interval=0))
    cfg.parallel.strategy = "fsdp"
    with pytest.raises(ConfigError, match=r"train.compile=True: expected false with parallel.strategy='fsdp'"):
        validate(cfg)


def test_one_graph_per_kind_of_module_whatever_the_depth():
    """Last in this file: it resets dynamo's caches, which the tests above share. Compiled graphs counted for 2 and 5 layers: the same number (the layers share them, their parameters are
    graph inputs), and no graph break (the RoPE kernel and the weight-cast Function stay out of the graphs)."""
    graphs = {}
    for layers in (2, 5):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Transformer(model_config(layers))
        model.set_compile(True)
        loss_and_grads(model, tokens(4))
        graphs[layers] = counters["stats"]["unique_graphs"]
        assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[2] == graphs[5] > 0, graphs
