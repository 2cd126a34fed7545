"""The model on a GPU: every expert backend gives the reference's output and gradients (bf16 tolerance)."""

import pytest
import torch

from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@cuda
@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_model_backends_match_reference_on_gpu(backend):
    cfg = ModelConfig(vocab_size=1000, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                      dense_hidden=512, num_experts=16, expert_hidden=128, shared_expert_hidden=128,
                      router=RouterConfig(top_k=4))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    tokens = torch.randint(0, 1000, (3, 77), device="cuda")  # 231 tokens: fits no block size
    results = {}
    for b in ("reference", backend):
        for layer in model.moe_layers():
            layer.gemm_backend = b
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
        (ce + aux).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "experts" in n}
        results[b] = (ce.detach(), grads)
    assert abs(float(results[backend][0] - results["reference"][0])) < 2e-2
    for name, g in results["reference"][1].items():
        assert rel(results[backend][1][name], g) < 3e-2, name


@cuda
def test_bench_command_runs_on_gpu(capsys):
    import json

    from moe_train.cli import main

    assert main(["bench", "--preset", "tiny", "--steps", "3", "--warmup", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mfu"] is not None and out["peak_mem_gib"] > 0
