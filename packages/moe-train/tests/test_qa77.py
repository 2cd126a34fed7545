"""QA 77: train.compile as a user turns it on, past what test_compile.py tries.

A bad target under compile raises eager's IndexError (inductor's CPU kernel ended the process); a copy of a compiled
model (copy.deepcopy, torch.save of the module) runs compiled (it said compiled=True and ran eager). Through the
Trainer with activation checkpointing, grad_accum 2, the expert-bias update and evals with a short last batch: a
compiled run resumed eager, and an eager run resumed compiled, log the losses of an eager run to fp32 rounding; the
two compiled runs compile 12 graphs between them (4 compiled functions x training, eval, the short eval batch) and
never reach dynamo's recompile limit (past it dynamo runs eager without an error). On two gloo ranks (dp=2, ep=2,
bf16 resident weights): the eager losses. Measured by hand, not here: a float64 model, a dense-only model, one with
no dense layer, random routing, tied embeddings; HF export of a compiled run; `moe-train bench --train.compile=true`.
"""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).parent))
import qa77_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from test_parallel_harness import small_config  # noqa: E402

from moe_train.model import Transformer  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402

COMPILED_FUNCTIONS = 4  # RMSNorm.forward, Attention.forward, SwiGLU.forward, cross_entropy


def _records(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, "loss" | "eval_loss") -> value, over a run's metrics.jsonl (a resumed run's records included)."""
    rows = list(map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()))
    return {(r["step"], key): r[key] for r in rows for key in ("loss", "eval_loss") if key in r}


def _assert_same_losses(got: dict, want: dict, rel: float) -> None:
    """Every record of `want` in `got` (a split run logs its stop step too), equal to `rel`."""
    assert set(want) <= set(got), (got, want)
    for key, value in want.items():
        assert abs(got[key] - value) <= rel * abs(value), (key, got, want)


@pytest.mark.filterwarnings("ignore:the learning-rate schedule differs")
def test_compiled_runs_resumed_across_the_setting_log_the_eager_losses_in_12_graphs(tmp_path, data_dir):
    """Straight eager (6 steps) against: compiled for 3 steps (activation checkpointing full) then resumed eager
    to 6, and eager for 3 steps then resumed compiled to 6 (activation checkpointing mlp). eval_windows=9 at
    micro-batch 4: eval batches of 4, 4 and 1. Dynamo's caches are emptied first, and a hit of its recompile limit
    raises here instead of running eager; the resumed compiled run compiles nothing new."""
    def run(name: str, steps: int, **train) -> dict:
        cfg = small_config(tmp_path / name, steps=steps, eval_interval=2, eval_windows=9, save_interval=3, **train)
        cfg.data.path = str(data_dir)
        Trainer(cfg).train()
        return _records(Path(cfg.train.run_dir))

    want = run("straight", 6)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        run("compiled_then_eager", 3, compile=True, activation_checkpointing="full")
        graphs_first = counters["stats"]["unique_graphs"]
        compiled_then_eager = run("compiled_then_eager", 6)
        run("eager_then_compiled", 3)
        eager_then_compiled = run("eager_then_compiled", 6, compile=True, activation_checkpointing="mlp")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs_first == counters["stats"]["unique_graphs"] == 3 * COMPILED_FUNCTIONS, dict(counters["stats"])
    _assert_same_losses(compiled_then_eager, want, 1e-5)
    _assert_same_losses(eager_then_compiled, want, 1e-5)


def _compiled_parts(model: Transformer) -> list[bool]:
    """Whether each module set_compile compiles has its compiled call."""
    parts = [model.norm]
    for block in model.blocks:
        parts += [block.attn_norm, block.attn, block.mlp_norm] + ([] if block.is_moe else [block.mlp])
    return [m._compiled_call_impl is not None for m in parts]


def test_a_deepcopy_or_a_saved_module_of_a_compiled_model_runs_compiled():
    """copy.deepcopy (an EMA or a reference copy) and torch.save of the module: nn.Module drops what compile()
    set, so the copy said compiled=True and ran every module eager."""
    torch.manual_seed(0)
    model = Transformer(small_config(Path("unused")).model)  # the Trainer test's shapes: its graphs serve here
    model.set_compile(True)
    batch = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(1))
    want = model.loss(batch[:, :-1], batch[:, 1:].contiguous())[0]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert copied.compiled and all(_compiled_parts(copied)), _compiled_parts(copied)
        assert list(copied.state_dict()) == list(model.state_dict())
        torch.testing.assert_close(copied.loss(batch[:, :-1], batch[:, 1:].contiguous())[0], want, rtol=0, atol=0)
    copied.set_compile(False)
    assert not any(_compiled_parts(copied)) and all(_compiled_parts(model))


BAD_TARGETS = """
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1])
from test_parallel_harness import small_config

from moe_train.model import Transformer

torch.manual_seed(0)
model = Transformer(small_config(Path("unused")).model)  # the Trainer test's shapes: inductor's disk cache has them
model.set_compile(True)
batch = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
x, y = batch[:, :-1], batch[:, 1:].contiguous()
good = model.loss(x, y)[0]
for bad in (512, -1):
    wrong = y.clone()
    wrong[1, 3] = bad
    try:
        model.loss(x, wrong)
        print("no error", bad)
    except IndexError as e:
        print("IndexError", e)
print("again", model.loss(x, y)[0].item() == good.item())
"""


def test_a_target_outside_the_vocabulary_under_compile_raises_eager_index_error():
    """Transformer.loss documents a target outside [0, vocab_size) (other than -100) as an error; eager raises
    IndexError, the compiled cross-entropy's CPU kernel called std::terminate (the process ended, in a training
    forward or not). In a child process, since that ends it."""
    out = subprocess.run([sys.executable, "-c", BAD_TARGETS, str(Path(__file__).parent)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    want = ["IndexError Target 512 is out of bounds.", "IndexError Target -1 is out of bounds.", "again True"]
    assert out.stdout.splitlines() == want, out.stdout


def test_two_ranks_dp2_ep2_bf16_compiled_log_the_eager_losses(tmp_path, data_dir):
    """dp=2, ep=2, parallel.param_dtype=bf16 (gloo), 4 steps with evals, eager then compiled on the same ranks:
    the same losses to 1e-4 relative (bf16 weights: eager fp32 weights move them by about as much, 2e-5 by hand),
    no graph break, 8 graphs on each rank (4 functions x training and eval)."""
    out = tmp_path / "ranks"
    out.mkdir()
    ports = [h.free_port() for _ in range(2)]
    h.start_ranks(h.run_guarded, args=(w.eager_and_compiled, str(out), ports, str(tmp_path), str(data_dir)), nprocs=2)
    for result in h.load_results(out, 2):
        assert result["graph_breaks"] == {} and result["graphs"] == 2 * COMPILED_FUNCTIONS, result
    _assert_same_losses(_records(tmp_path / "compiled"), _records(tmp_path / "eager"), 1e-4)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Dynamo's caches hold at most recompile_limit graphs per function across the process (other test files'
    shapes count): this file starts and leaves them empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
