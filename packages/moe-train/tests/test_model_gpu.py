"""The model on a GPU: every expert backend is as close to the fp32 truth as the bf16 reference is.

A whole-model backward at random init has gradients with heavy cancellation, so bf16 paths differ
from each other by several percent; the fair check is each fast backend's error against the fp32
model, bounded by the bf16 reference backend's own error.
"""

import pytest
import torch

from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def loss_and_expert_grads(model, tokens, backend, bf16):
    for layer in model.moe_layers():
        layer.gemm_backend = backend
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
    (ce + aux).backward()
    return float(ce), {n: p.grad.detach().clone() for n, p in model.named_parameters() if "experts" in n}


@cuda
@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_model_backends_are_as_accurate_as_the_reference_on_gpu(backend):
    cfg = ModelConfig(vocab_size=1000, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                      dense_hidden=512, num_experts=16, expert_hidden=128, shared_expert_hidden=128,
                      router=RouterConfig(top_k=4))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    tokens = torch.randint(0, 1000, (3, 78), device="cuda")  # 231 tokens: fits no block size
    truth_loss, truth = loss_and_expert_grads(model, tokens, "reference", bf16=False)
    ref_loss, ref = loss_and_expert_grads(model, tokens, "reference", bf16=True)
    fast_loss, fast = loss_and_expert_grads(model, tokens, backend, bf16=True)
    assert abs(fast_loss - truth_loss) <= 2 * abs(ref_loss - truth_loss) + 1e-2
    for name, g in truth.items():
        err_ref, err_fast = rel(ref[name], g), rel(fast[name], g)
        assert err_fast <= 1.5 * err_ref + 1e-2, (name, err_fast, err_ref)


@cuda
def test_bench_command_runs_on_gpu(capsys):
    import json

    from moe_train.cli import main

    assert main(["bench", "--preset", "tiny", "--steps", "3", "--warmup", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mfu"] is not None and out["peak_mem_gib"] > 0


@cuda
def test_training_on_gpu_resumes_to_the_unbroken_runs_state(tmp_path, data_dir, make_config):
    """4 steps on the GPU in one go against 2 steps, a checkpoint, and a resumed run to 4: the step-4
    checkpoints agree (per-parameter AdamW step counts exactly; weights and moments to bf16-autocast noise)."""
    from moe_ckpt import load_checkpoint, step_dir
    from moe_train.trainer.loop import Trainer

    def run(name, steps):
        cfg = make_config(tmp_path / name, steps=steps, eval_interval=0, save_interval=2, device="cuda")
        cfg.data.path = str(data_dir)
        return Trainer(cfg).train(), tmp_path / name / "run" / "checkpoints"

    _, unbroken = run("unbroken", 4)
    run("resumed", 2)
    summary, resumed = run("resumed", 4)
    assert summary["step"] == 4
    want, got = load_checkpoint(step_dir(unbroken, 4)), load_checkpoint(step_dir(resumed, 4))
    assert set(want) == set(got)
    steps = [n for n in want if n.startswith("optim.") and n.endswith(".step")]
    assert len(steps) > 1 and all(float(want[n]) == float(got[n]) == 4.0 for n in steps)
    for name, t in want.items():
        assert torch.isfinite(got[name]).all(), name
        assert rel(got[name], t) < 5e-3, (name, rel(got[name], t))
