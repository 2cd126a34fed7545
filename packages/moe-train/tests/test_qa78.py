"""QA 78: randomness as a user who relies on reproducibility sees it, with `model.router.routing=random` (the one
setting that draws random numbers in every training forward). A run is bitwise reproducible: the same config twice,
2N steps straight against N, Ctrl-C, resume (sync and async saves), with activation checkpointing (full and mlp: the
recompute draws the forward's experts), and on two gloo ranks. How often a run evaluates does not change its
training (eval forwards draw from a copy of the generators; before, each eval advanced them and moved every later
step). train.seed picks the init and the draws; data.seed only the data order.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import qa76_worker  # noqa: E402
import qa78_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from test_parallel_harness import small_config  # noqa: E402

from moe_ckpt import load_metadata  # noqa: E402
from moe_train.model.router import Router  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402

N = 6  # the stop: its checkpoint is at step N; a run is 2N steps


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    from moe_train.data import prepare_data, stdlib_documents

    out = tmp_path_factory.mktemp("qa78") / "data"
    return prepare_data(list(stdlib_documents(15_000)), out, vocab_size=512, source="qa78", eval_fraction=0.25)


def _config(root: Path, name: str, data: Path, **train):
    cfg = small_config(root, **{"steps": 2 * N, "micro_batch_size": 4, "grad_accum": 2, "eval_interval": 0,
                                "log_interval": 1, "save_interval": N, "keep_last": 3, "device": "cpu", **train})
    cfg.data.path = str(data)
    cfg.train.run_dir = str(root / name)
    return w.random_routing(cfg)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> list[tuple]:
    """(step, loss, aux_loss, grad_norm, router health) of each step record: what the step computed."""
    return [(r["step"], r["loss"], r["aux_loss"], r["grad_norm"], r["router"]) for r in _records(run) if "loss" in r]


def _evals(run: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in _records(run) if "eval_loss" in r}


def _tensors(run: Path, step: int = 2 * N) -> dict[str, torch.Tensor]:
    """Every tensor (weights, AdamW state) of the run's checkpoint at `step`, as {file/name: tensor}."""
    checkpoint = run / "checkpoints" / f"step-{step:08d}"
    return {f"{shard.name}/{name}": t for shard in sorted(checkpoint.glob("*.safetensors"))
            for name, t in load_file(shard).items()}


def _assert_same_run(run: Path, want: Path) -> None:
    """Bitwise: every step's losses, grad norm and router health, and every tensor of the last checkpoint."""
    assert _losses(run) == _losses(want)
    got, expected = _tensors(run), _tensors(want)
    assert sorted(got) == sorted(expected)
    differ = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not differ, f"{len(differ)} of {len(expected)} tensors differ, e.g. {differ[:3]}"


def _stopped_then_resumed(root: Path, name: str, data: Path, **train) -> None:
    """2N steps, Ctrl-C during step N+3 (its checkpoint at N), then a new Trainer resumes to 2N."""
    trainer = Trainer(_config(root, name, data, **train))
    qa76_worker.ctrl_c_in_step(trainer, N + 3)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    del trainer
    assert Trainer(_config(root, name, data, **train)).train()["step"] == 2 * N
    assert [r.get("resumed_from_step") for r in _records(root / name) if r.get("event") == "start"] == [None, N]


def _recorded_draws(monkeypatch) -> list[torch.Tensor]:  # noqa: ANN001
    """The expert ids of every training forward's router from now on (this process; undone after the test)."""
    draws: list[torch.Tensor] = []
    select = Router._select

    def recorded(self: Router, scores: torch.Tensor, k: int) -> torch.Tensor:
        ids = select(self, scores, k)
        if self.training and not self.recomputing:
            draws.append(ids.clone())
        return ids

    monkeypatch.setattr(Router, "_select", recorded)
    return draws


def test_random_routing_runs_twice_and_resumed_are_bitwise_identical(tmp_path, small_data):
    """Same config twice; stopped at N+3 and resumed from N with sync and with async saves (evals every 5 in all,
    so the resume also crosses evals). A resume that left the generators where the new Trainer seeded them (the RNG
    state not restored) draws other experts from step N+1: its losses differ from step N+1 on."""
    runs = {"straight": {}, "again": {}, "split": {}, "split_async": {"async_save": True}}
    for name, train in runs.items():
        if name.startswith("split"):
            _stopped_then_resumed(tmp_path, name, small_data, eval_interval=5, **train)
        else:
            Trainer(_config(tmp_path, name, small_data, eval_interval=5, **train)).train()
    straight = tmp_path / "straight"
    assert len(_losses(straight)) == 2 * N
    for name in ("again", "split", "split_async"):
        _assert_same_run(tmp_path / name, straight)
        assert _evals(tmp_path / name) == _evals(straight)


@pytest.mark.parametrize("mode", ["full", "mlp"])
def test_activation_checkpointing_recomputes_the_forwards_random_experts(tmp_path, small_data, mode):
    """The recompute in backward draws the experts its forward drew (the checkpoint restores the generators), and
    draws nothing from the stream the next forward reads: losses, gradient norms and every weight and AdamW moment
    equal the run without recompute bitwise, stopped and resumed too. A recompute that drew afresh (another expert
    choice in backward than in forward) gives other gradients from step 1."""
    Trainer(_config(tmp_path, "none", small_data)).train()
    Trainer(_config(tmp_path, mode, small_data, activation_checkpointing=mode)).train()
    _assert_same_run(tmp_path / mode, tmp_path / "none")
    _stopped_then_resumed(tmp_path, f"{mode}-split", small_data, activation_checkpointing=mode)
    _assert_same_run(tmp_path / f"{mode}-split", tmp_path / "none")


def _states_before_draws(monkeypatch, generator_state) -> list[torch.Tensor]:  # noqa: ANN001
    """generator_state(scores) just before every training draw of the routers from now on (undone after the test)."""
    states: list[torch.Tensor] = []
    select = Router._select

    def recorded(self: Router, scores: torch.Tensor, k: int) -> torch.Tensor:
        if self.training and not self.recomputing:
            states.append(generator_state(scores))
        return select(self, scores, k)

    monkeypatch.setattr(Router, "_select", recorded)
    return states


def _torch_cpu_state(rng: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(rng["torch_cpu"])), dtype=torch.uint8)


def test_evals_leave_the_training_run_as_it_is(tmp_path, small_data):
    """A run that evaluates every 5 steps, or every 2, trains as one that never evaluates: the same losses, router
    health, weights and AdamW state, bitwise. And the eval losses of the steps both evaluate at (0, 10, 12) agree:
    an eval sees the run's state at its step whatever the evals before it. Before, each eval forward advanced the
    generator the training forwards draw from: every step after the first eval (at step 0) routed other tokens to
    other experts, and the loss of step 1 already differed (6.239720 against 6.239706)."""
    for name, every in (("never", 0), ("every5", 5), ("every2", 2)):
        Trainer(_config(tmp_path, name, small_data, eval_interval=every)).train()
    _assert_same_run(tmp_path / "every5", tmp_path / "never")
    _assert_same_run(tmp_path / "every2", tmp_path / "never")
    every5, every2 = _evals(tmp_path / "every5"), _evals(tmp_path / "every2")
    assert sorted(every5) == [0, 5, 10, 12] and sorted(every2) == [0, 2, 4, 6, 8, 10, 12]
    assert {s: every5[s] for s in (0, 10, 12)} == {s: every2[s] for s in (0, 10, 12)}


def test_train_seed_picks_init_and_draws_and_data_seed_only_the_data_order(tmp_path, small_data, monkeypatch):
    """One step each. train.seed=1 against 0: other initial weights and other expert draws. data.seed=1 against 0:
    the same initial weights and the same draws (the generator the routers read is train.seed's alone), other
    windows, so another loss."""
    draws = _recorded_draws(monkeypatch)
    runs: dict[str, dict] = {}
    for name, seed, data_seed in (("base", 0, 0), ("seed1", 1, 0), ("data1", 0, 1)):
        cfg = _config(tmp_path, name, small_data, steps=1, warmup_steps=1, save_interval=0, seed=seed)
        cfg.data.seed = data_seed
        trainer = Trainer(cfg)
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        windows = copy.deepcopy(trainer.sampler).next_batch(4, 0, 1)[0]  # the first micro-batch's windows
        del draws[:]
        trainer.train()
        runs[name] = {"weights": weights, "draws": [d.clone() for d in draws], "loss": _losses(tmp_path / name)[0][1],
                      "windows": windows}
    base, seed1, data1 = runs["base"], runs["seed1"], runs["data1"]
    assert len(base["draws"]) == 2 * 1 and all(d.shape == (4 * 32, 2) for d in base["draws"])  # 1 MoE layer x 2 micro
    # train.seed: every weight and every draw
    assert all(not torch.equal(base["weights"][n], seed1["weights"][n]) for n in base["weights"] if "norm" not in n)
    assert all(not torch.equal(a, b) for a, b in zip(base["draws"], seed1["draws"]))
    # data.seed: the data alone
    assert all(torch.equal(base["weights"][n], data1["weights"][n]) for n in base["weights"])
    assert all(torch.equal(a, b) for a, b in zip(base["draws"], data1["draws"]))
    assert not torch.equal(base["windows"], data1["windows"])
    assert base["loss"] != data1["loss"]


def test_two_ranks_random_routing_resume_is_bitwise_and_the_ranks_draw_alike(tmp_path, small_data, monkeypatch):
    """dp=2 (gloo), random routing, evals every 3, async saves: 2N straight against stopped at N+3 and resumed, bitwise.
    Every rank seeds its generator with train.seed and draws the same number of values, so the ranks draw the same
    experts for the same token positions (of different data) and their generator states agree at every save: the
    checkpoint keeps rank 0's state and every rank restores it, which is right only while they agree. Then the
    step-N checkpoint resumed on one process (another world size), twice: bitwise the same, and its first draw starts
    from the saved generator state (before moe-train 0.17.2 another world size restarted the draws from train.seed,
    repeating step 1's, and said nothing)."""
    out = tmp_path / "ranks"
    out.mkdir()
    ports = [h.free_port() for _ in range(3)]
    h.start_ranks(h.run_guarded, args=(w.straight_and_split, str(out), ports, str(tmp_path), str(small_data), N),
                  nprocs=2)
    results = h.load_results(out, 2)
    for r, result in enumerate(results):
        assert "error" not in result, f"rank {r}: {result.get('error')}"
        assert "SIGINT" in result["stopped"], result["stopped"]
    assert torch.equal(results[0]["first_ids"], results[1]["first_ids"])
    assert all(torch.equal(a, b) for a, b in zip(results[0]["rng"], results[1]["rng"]))
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert len(list((straight / "checkpoints" / f"step-{2 * N:08d}").glob("*.safetensors"))) == 2  # a file a rank
    _assert_same_run(split, straight)
    assert _evals(split) == _evals(straight) and sorted(_evals(straight)) == [0, 3, 6, 9, 12]

    # the dp=2 checkpoint at N, resumed on one process, twice
    saved = straight / "checkpoints" / f"step-{N:08d}"
    states = _states_before_draws(monkeypatch, lambda scores: torch.get_rng_state())
    for name in ("one", "one_again"):
        run = tmp_path / name
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(saved, run / "checkpoints" / f"step-{N:08d}")
        Trainer(_config(tmp_path, name, small_data, micro_batch_size=4, grad_accum=2)).train()
    per_run = len(states) // 2  # the two resumed runs draw alike: the first draw of each starts from the saved state
    assert per_run > 0 and len(states) == 2 * per_run
    saved_state = _torch_cpu_state(load_metadata(saved)["rng"])
    assert torch.equal(states[0], saved_state) and torch.equal(states[per_run], saved_state)
    assert [s for s, *_ in _losses(tmp_path / "one")] == list(range(N + 1, 2 * N + 1))
    _assert_same_run(tmp_path / "one_again", tmp_path / "one")


def test_the_cli_trains_as_the_api_does(tmp_path, small_data):
    """`moe-train train` with random routing gives the Trainer's losses and weights bitwise (same config, same
    seed): the CLI seeds and threads nothing differently."""
    Trainer(_config(tmp_path, "api", small_data)).train()
    cfg = _config(tmp_path, "cli", small_data)
    # every field given (the tiny preset under it changes nothing); JSON is YAML
    (tmp_path / "cli.json").write_text(json.dumps({k: v for k, v in cfg.to_dict().items() if k != "preset"}))
    subprocess.run([sys.executable, "-m", "moe_train", "train", "--config", str(tmp_path / "cli.json")], check=True,
                   capture_output=True, timeout=120)
    _assert_same_run(tmp_path / "cli", tmp_path / "api")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_resume_on_the_gpu_goes_on_with_the_cuda_generator(tmp_path, small_data, monkeypatch):
    """On a CUDA device the routers draw from the device's generator: the resumed run's first draw starts from the
    state the unbroken run had at that draw (the checkpoint keeps the current device's state, moe-ckpt 0.14.0)."""
    states = _states_before_draws(monkeypatch, lambda scores: torch.cuda.get_rng_state(scores.device))
    Trainer(_config(tmp_path, "straight", small_data, device="cuda")).train()
    draws_per_step = len(states) // (2 * N)
    assert draws_per_step == 2 and len(states) == 2 * N * draws_per_step  # 2 micro-batches x 1 MoE layer
    straight = states[:]
    del states[:]
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / f"step-{N:08d}",
                    tmp_path / "resumed" / "checkpoints" / f"step-{N:08d}")
    Trainer(_config(tmp_path, "resumed", small_data, device="cuda")).train()
    assert len(states) == N * draws_per_step
    assert all(torch.equal(a, b) for a, b in zip(states, straight[N * draws_per_step:]))
