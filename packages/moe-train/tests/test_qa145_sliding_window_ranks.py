"""QA 145: model.sliding_window_pattern across ranks, layouts, compile, the CLI and HF export / import.

- Two gloo ranks (qa145_worker.py) train a windowed, document-masked model at dp=2, dp=2 x ep=2 (also with
  activation checkpointing and a chunked loss), the FSDP2 baseline and bf16 resident weights, as one process does
  (losses, and weights to 1e-4 of each tensor's scale); real Trainers (eval on 5 sequences, not a multiple of dp)
  resume a one-process windowed checkpoint at dp=2 x ep=2 and dp=2, a dp=2 x ep=2 one in one process, and match
  the unbroken one-process run's losses and eval losses.
- train.compile on the CPU (sdpa): eager's loss and gradients, the graphs of the first step serve the next ones.
- The CLI: a YAML file with the field, overridden on the command line; train, export-hf (stock Qwen3; an MoE with
  a shared expert only with --custom-code), transformers' logits equal the trained model's, import-hf keeps the
  pattern, --train.init_from of it trains on; `moe-train info`'s FLOPs fall with the window.
- A window of 1 under bf16 / fp16 CPU autocast: each token reads itself alone; finite loss and gradients.
No defect found: every check here passed on first run against 0.26.1 (regression coverage).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import layout_resume_worker as lw  # noqa: E402
import qa145_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from hf_logits_helpers import hf_home  # noqa: E402,F401 - fixture

# transformers' caches in a temporary folder: a custom-code load under the home folder left transformers_modules
# bound to it (and on sys.path), and a later module's custom-code folder was then not found (test_qa86 failed)
pytestmark = pytest.mark.usefixtures("hf_home")

from moe_train.config import ModelConfig, RouterConfig  # noqa: E402
from moe_train.trainer.runtime import LocalRuntime  # noqa: E402

RESUMES = {"one_to_dp2ep2": (2, 2), "one_to_dp2": (2, 1)}  # seeded with the one-process run's step-3 checkpoint


def resume_config(root: Path, data: Path, name: str, dp: int, ep: int, steps: int = 6):
    model = ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                        dense_hidden=64, dense_layers=[0], num_experts=4, expert_hidden=16, shared_expert_hidden=16,
                        router=RouterConfig(top_k=2, expert_bias=True, lb_loss_scope="global"),
                        sliding_window_pattern=[5, 0])
    cfg = lw.run_config(model, data, root / name, steps, dp, ep)
    cfg.train.document_masking = True
    cfg.train.eval_interval, cfg.train.eval_windows = 3, 5  # 5 eval sequences: not a multiple of dp=2
    return cfg


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    root = tmp_path_factory.mktemp("qa145")
    data = prepare_data(list(stdlib_documents(60_000)), root / "data", vocab_size=512, source="stdlib-test")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lw.run_trainer(resume_config(root, data, "one", 1, 1))  # the unbroken reference, saves at step 3
        for name in RESUMES:
            lw.seed_run_dir(root / "one", root / name)
        resumes = [resume_config(root, data, name, dp, ep) for name, (dp, ep) in RESUMES.items()]
        resumes.append(resume_config(root, data, "dp2ep2", 2, 2))  # unbroken at dp=2 x ep=2, saves at step 3
        out_dir = root / "spawn"
        out_dir.mkdir()
        ports = [h.free_port() for _ in range(len(w.LAYOUTS) + len(resumes))]
        h.start_ranks(h.run_guarded, args=(w.worker2, str(out_dir), ports, w.token_stream(), resumes), nprocs=2)
        two = h.load_results(out_dir, 2)
        lw.seed_run_dir(root / "dp2ep2", root / "dp2ep2_to_one")
        lw.run_trainer(resume_config(root, data, "dp2ep2_to_one", 1, 1))
        one = {}
        for name, pattern in (("one", None), ("one_bf16", None), ("one_causal", [])):
            cfg = w.layout(name if name != "one_causal" else "one", pattern)
            one[name] = w.run(cfg, LocalRuntime(cfg, torch.device("cpu")), w.token_stream(), w.EOS)
    finally:
        torch.set_num_threads(threads)
    return {"root": root, "two": two, "one": one}


@pytest.mark.parametrize("name", ["dp2", "dp2_ep2", "fsdp", "dp2_ep2_recompute_chunks"])
def test_two_ranks_train_the_windowed_model_as_one_process_does(ranks, name):
    want = ranks["one"]["one"]
    for rank, res in enumerate(ranks["two"]):
        assert res[name]["windows"] == [3, 0, 6], rank
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(want["losses"]),
                                   rtol=1e-5, atol=1e-6)
    got = h.assemble([res[name]["weights"] for res in ranks["two"]])
    for n, (_, _, v) in want["weights"].items():
        err = ((got[n] - v).abs().max() / v.abs().max()).item()
        assert err < 1e-4, f"{name}: {n} differs by {err:.2e} relative to its largest entry"
    causal = ranks["one"]["one_causal"]["losses"]
    assert abs(causal[0] - want["losses"][0]) > 1e-4  # the windows change the very first loss


def test_bf16_resident_weights_train_the_windowed_model_as_one_bf16_process_does(ranks):
    want = ranks["one"]["one_bf16"]["losses"]
    for res in ranks["two"]:
        got = res["bf16"]["losses"]
        assert all(torch.isfinite(torch.tensor(got)))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("resumed", [*RESUMES, "dp2ep2", "dp2ep2_to_one"])
def test_a_windowed_checkpoint_resumes_on_another_layout_as_the_unbroken_run(ranks, resumed):
    got, want = lw.losses(ranks["root"] / resumed), lw.losses(ranks["root"] / "one")
    steps = [1, 2, 3, 4, 5, 6] if resumed == "dp2ep2" else [4, 5, 6]
    assert sorted(got) == steps, got
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    start = [json.loads(x) for x in (ranks["root"] / resumed / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("event") == "start"]
    assert [r["resumed_from_step"] for r in start] == ([None] if resumed == "dp2ep2" else [3])


def _eval_losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["eval_loss"] for r in map(json.loads, lines) if "eval_loss" in r}


@pytest.mark.parametrize("resumed", [*RESUMES, "dp2ep2", "dp2ep2_to_one"])
def test_two_ranks_evaluate_the_windowed_model_as_one_process(ranks, resumed):
    got, want = _eval_losses(ranks["root"] / resumed), _eval_losses(ranks["root"] / "one")
    assert 6 in got and 6 in want, (got, want)
    assert abs(got[6] - want[6]) <= 1e-5 * abs(want[6]), (got, want)


# ---- train.compile on the CPU (sdpa) -------------------------------------------------------------------------------
def _loss_and_grads(model, batch: torch.Tensor):  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    ce, aux = model.loss(batch[:, :-1], batch[:, 1:].contiguous())
    (ce + aux).backward()
    return ce.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_windows_give_eager_losses_with_graphs_per_mask_not_per_step():
    """Layers of windows 3, full, 5, full (a document mask too), fp32 on the CPU: the compiled model gives eager's
    loss and gradients; the graphs made by the first step serve the next two (new tokens, new document ends), with
    no graph break."""
    from torch._dynamo.utils import counters

    from moe_train.model import Transformer

    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, qk_norm=True,
                      dense_hidden=48, dense_layers=[0], num_experts=4, expert_hidden=16,
                      router=RouterConfig(top_k=2), sliding_window_pattern=[3, 0, 5, 0])
    torch.manual_seed(0)
    eager, compiled = Transformer(cfg), Transformer(cfg)
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        m.set_document_masking(1, kernel="sdpa")
    compiled.set_compile(True)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for seed in range(3):
        batch = torch.randint(2, 64, (2, 13), generator=torch.Generator().manual_seed(seed))
        batch[:, seed + 3] = 1  # a document end in another place each step
        (want, want_g), (got, got_g) = _loss_and_grads(eager, batch), _loss_and_grads(compiled, batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for n, g in want_g.items():
            torch.testing.assert_close(got_g[n], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert 0 < graphs[0] == graphs[1] == graphs[2], graphs
    torch._dynamo.reset()


# ---- the CLI end to end --------------------------------------------------------------------------------------------
def _cli_yaml(tmp_path: Path, data_dir: Path, name: str, **model) -> Path:
    """A run of 3 steps on the data_dir fixture, as a YAML file a user writes (the window field in it)."""
    import yaml

    from conftest import small_config

    cfg = small_config(tmp_path / name, steps=3, save_interval=3, eval_interval=0, warmup_steps=1, log_interval=1)
    cfg.data.path = str(data_dir)
    stored = cfg.to_dict()
    stored.pop("preset")
    stored["model"].update(model)
    stored["train"]["document_masking"] = True
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(stored))
    return path


def _trained_model(run_dir: Path):  # noqa: ANN202
    """The run's model as its last checkpoint holds it, built from the config the checkpoint stored."""
    from moe_ckpt.hf import tensor_getter
    from moe_train.hf_bridge import open_checkpoint_source
    from moe_train.model import Transformer

    with open_checkpoint_source(run_dir) as (cfg, source):
        model = Transformer(cfg.model)
        get = tensor_getter(source)
        state = {n: get(n).clone() for n in model.state_dict()}
    model.load_state_dict(state)
    return model.eval()


def _info_flops(capsys, *args: str) -> int:
    from moe_train.cli import main

    capsys.readouterr()
    assert main(["info", *args]) == 0
    return json.loads(capsys.readouterr().out)["flops_per_token"]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_cli_trains_exports_imports_and_inits_from_a_windowed_run(tmp_path, data_dir, capsys):
    """YAML [8, 0] overridden by --model.sliding_window_pattern=[3,0] on a dense QK-norm model: train, export-hf
    (stock Qwen3, layer_types), transformers' logits (eager and sdpa) equal the trained model's, import-hf keeps
    [3, 0] and --train.init_from of it starts where the run ended; info's FLOPs fall with the window."""
    pytest.importorskip("transformers")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from moe_train.cli import main

    config = _cli_yaml(tmp_path, data_dir, "dense", num_experts=0, dense_layers=[], sliding_window_pattern=[8, 0])
    run = tmp_path / "dense" / "run"
    assert main(["train", "--config", str(config), "--model.sliding_window_pattern=[3,0]"]) == 0
    capsys.readouterr()
    stored = json.loads(next(run.glob("checkpoints/step-*/metadata.json")).read_text())["config"]
    assert stored["model"]["sliding_window_pattern"] == [3, 0]
    model = _trained_model(run)
    assert model.cfg.sliding_window_pattern == [3, 0]

    hf_dir = tmp_path / "hf"
    assert main(["export-hf", str(run), str(hf_dir), "--dtype", "fp32"]) == 0
    hf_config = json.loads((hf_dir / "config.json").read_text())
    assert hf_config["sliding_window"] == 3 and hf_config["layer_types"] == ["sliding_attention", "full_attention"]
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)[0]
        for attn in ("eager", "sdpa"):
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                                   attn_implementation=attn).eval()
            assert type(hf).__name__ == "Qwen3ForCausalLM"
            assert (hf(ids).logits - ours).abs().max() < 1e-4, attn

    imported = tmp_path / "imported"
    assert main(["import-hf", str(hf_dir), str(imported)]) == 0
    assert json.loads((imported / "config.json").read_text())["model"]["sliding_window_pattern"] == [3, 0]
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--model.sliding_window_pattern=[3,0]",
                 f"--train.init_from={imported}", f"--train.run_dir={tmp_path / 'init'}", "--train.steps=1"]) == 0
    assert _losses(tmp_path / "init")[0] < _losses(run)[0]  # it starts from the trained weights

    full = _info_flops(capsys, "--config", str(config), "--model.sliding_window_pattern=[]")
    eight = _info_flops(capsys, "--config", str(config))
    three = _info_flops(capsys, "--config", str(config), "--model.sliding_window_pattern=[3,0]")
    assert full > eight > three


def test_cli_exports_a_windowed_moe_with_custom_code_only(tmp_path, data_dir, capsys):
    """An MoE with a shared expert and [3, 0] windows: the stock export is refused naming --custom-code; the
    custom-code export's logits equal the trained model's."""
    pytest.importorskip("transformers")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from moe_train.cli import main

    config = _cli_yaml(tmp_path, data_dir, "moe", sliding_window_pattern=[3, 0])
    run = tmp_path / "moe" / "run"
    assert main(["train", "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["export-hf", str(run), str(tmp_path / "stock"), "--dtype", "fp32"]) != 0
    assert "--custom-code" in capsys.readouterr().err
    assert main(["export-hf", str(run), str(tmp_path / "custom"), "--dtype", "fp32", "--custom-code"]) == 0
    model = _trained_model(run)
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "custom"), dtype=torch.float32,
                                                           trust_remote_code=True).eval()
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)[0]).abs().max() < 1e-4


# ---- a window of 1 under CPU autocast ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eos_id", [None, 1])
def test_a_window_of_one_under_autocast_reads_each_token_alone(dtype, eos_id):
    """Every layer's window 1: a token attends to itself only, so its logits do not depend on the tokens before it
    (changing them changes nothing at its position, under bf16 / fp16 autocast, with or without documents), the
    loss and every gradient are finite, and autocast's loss is eager fp32's to the low precision's rounding."""
    from moe_train.model import Transformer

    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                      dense_hidden=48, dense_layers=[0], num_experts=4, expert_hidden=16,
                      router=RouterConfig(top_k=2), sliding_window_pattern=[1])
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.set_document_masking(eos_id, kernel="sdpa")
    x = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    x[:, 5] = 1
    other = x.clone()
    other[:, :8] = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=dtype):
        a, b = model(x)[0], model(other)[0]
        ce, aux = model.loss(x[:, :-1], x[:, 1:].contiguous())
    assert torch.equal(a[:, 8:], b[:, 8:])
    assert not torch.equal(a[:, :8], b[:, :8])
    (ce + aux).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        want, _ = model.loss(x[:, :-1], x[:, 1:].contiguous())
    assert abs(ce.item() - want.item()) < 2e-2 * abs(want.item())
