"""QA 131: arguments of the wrong kind to the public API are refused naming the argument, the value and what was
expected, at construction; before, an integer grad_dtype was accepted and failed at the first backward ("result type
Float can't be cast to the desired output type Int"), a string one failed inside torch.zeros, cfg=None failed at the
first step and a rank given as text failed on a comparison."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
parallel_spawn = importlib.import_module("parallel_spawn")
from moe_parallel import ParallelLayout

# One gloo process of world 1 (its own interpreter: no process group is left in the test process).
CHECKS = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = "accepted"
        except Exception as e:
            out[key] = f"{type(e).__name__}: {e}"

    def params(tag):
        return [(f"{tag}.w", nn.Parameter(torch.ones(3)))]

    g = dist.group.WORLD
    attempt("grad_dtype_int", lambda: FlatParams(params("a"), g, False, grad_dtype=torch.int32))
    attempt("grad_dtype_str", lambda: FlatParams(params("b"), g, False, grad_dtype="bf16"))
    attempt("grad_dtype_fp32", lambda: FlatParams(params("c"), g, False, grad_dtype=torch.float32))
    attempt("cfg_none", lambda: DistributedAdamW([FlatParams(params("d"), g, False)], None))
    attempt("cfg_none_world", lambda: DistributedAdamW([FlatParams(params("e"), g, False)], None, world=g))
    attempt("cfg_dict", lambda: DistributedAdamW([FlatParams(params("f"), g, False)], {"lr": 1e-3}))
    dist.destroy_process_group()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def outcomes():
    proc = subprocess.run([sys.executable, "-c", CHECKS, str(parallel_spawn.free_port())], capture_output=True,
                          text=True, check=False, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_flat_params_refuses_a_grad_dtype_that_is_not_a_floating_torch_dtype(outcomes):
    want = ("ValueError: FlatParams: grad_dtype={}, expected a floating-point torch.dtype (e.g. torch.float32 for fp32 "
            "gradient accumulation) or None (the parameters' dtype)")
    assert outcomes["grad_dtype_int"] == want.format("torch.int32")  # before: accepted, failed at the first backward
    assert outcomes["grad_dtype_str"] == want.format("'bf16'")  # before: zeros(): argument 'dtype' must be ...
    assert outcomes["grad_dtype_fp32"] == "accepted"


def test_distributed_adamw_refuses_a_cfg_that_is_not_an_adamw_config(outcomes):
    want = ("TypeError: DistributedAdamW: cfg is a {}, expected an AdamWConfig (e.g. AdamWConfig(lr=3e-4, "
            "weight_decay=0.1))")
    assert outcomes["cfg_none"] == want.format("NoneType")  # before: accepted, AttributeError at the first step
    assert outcomes["cfg_none_world"] == want.format("NoneType")
    assert outcomes["cfg_dict"] == want.format("dict")


def test_layout_coords_refuses_a_rank_that_is_not_an_integer():
    layout = ParallelLayout(dp=2).validate(2, 0)
    with pytest.raises(ValueError, match=r"^rank='1': expected an integer in \[0, 2\)$"):
        layout.coords("1")  # before: TypeError: '<=' not supported between instances of 'int' and 'str'
    with pytest.raises(ValueError, match=r"^rank=1.0: expected an integer in \[0, 2\)$"):
        layout.coords(1.0)  # before: RankCoords(rank=1.0, pp_rank=0.0, dp_rank=1.0, ...)
    assert layout.coords(1).dp_rank == 1
    with pytest.raises(ValueError, match=r"^rank=2 is outside \[0, 2\)$"):
        layout.coords(2)
