"""Exported folders load in stock transformers (no trust_remote_code) and compute our function exactly."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_ckpt.hf import HFConversionError, export_hf_folder
from moe_train.config import Config, ModelConfig, RouterConfig, validate
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import one_thread  # noqa: E402,F401 - autouse: one torch thread for the module

BASE = dict(vocab_size=96, d_model=48, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden=80, num_experts=6,
            expert_hidden=24, init_std=0.08, rope_theta=5000.0, norm_eps=1e-5)

VARIANTS = {
    "qwen3_moe": dict(qk_norm=True, dense_layers=[1], router=dict(top_k=2)),
    "qwen3_moe_no_renorm": dict(qk_norm=True, router=dict(top_k=3, normalize_top_k=False)),
    "qwen2_moe_shared": dict(qk_norm=False, dense_layers=[0], shared_expert_hidden=40, head_dim=16,
                             router=dict(top_k=2)),
    "qwen2_moe_routed_only": dict(qk_norm=False, tie_embeddings=True, router=dict(top_k=2, normalize_top_k=False)),
    "glm4_moe_shared_bias": dict(qk_norm=True, dense_layers=[0], shared_expert_hidden=48,
                                 router=dict(gating="sigmoid", top_k=2, expert_bias=True)),
    "glm4_moe_plain": dict(qk_norm=False, router=dict(gating="sigmoid", top_k=2, normalize_top_k=False)),
    "qwen3_dense": dict(qk_norm=True, num_experts=0),
    "llama_dense": dict(qk_norm=False, num_experts=0, tie_embeddings=True),
}
ARCHS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
         "qwen3_dense": "Qwen3ForCausalLM", "llama_dense": "LlamaForCausalLM"}




def make_model(seed: int = 0, **overrides) -> Transformer:
    """A tiny fp32 model with non-trivial norms, routers and expert biases (so a wrong mapping shows)."""
    kw = {**BASE, **overrides}
    router = RouterConfig(**kw.pop("router", {}))
    cfg = validate(Config(model=ModelConfig(router=router, **kw))).model
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for _, router_mod in model.routers():
            router_mod.expert_bias.copy_(0.1 * torch.randn_like(router_mod.expert_bias))
    return model.eval()


def export(model: Transformer, out, dtype: str = "fp32", **kw):
    return export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), out, dtype=dtype, **kw)


def load_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model: Transformer, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        logits, _ = model(ids)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_logits_and_greedy_match_ours(variant, tmp_path):
    model = make_model(**VARIANTS[variant])
    summary = export(model, tmp_path)
    assert summary.architecture == next(a for k, a in ARCHS.items() if variant.startswith(k))
    hf = load_hf(tmp_path)
    assert type(hf).__name__ == summary.architecture
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    prompt = tokens[:1, :5]
    with torch.no_grad():
        generated = hf.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert torch.equal(generated, greedy(model, prompt, 16))


def test_bf16_export_loads_close_to_ours(tmp_path):
    model = make_model(**VARIANTS["glm4_moe_shared_bias"])
    summary = export(model, tmp_path, dtype="bf16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert summary.total_bytes < 0.6 * sum(t.numel() * 4 for t in model.state_dict().values())
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (model(tokens)[0] - hf(tokens).logits).abs().max().item()
    assert diff < 0.1  # bf16 weights: close, not exact


def test_sharded_export_writes_an_index_transformers_reads(tmp_path):
    model = make_model(**VARIANTS["qwen3_moe"])
    summary = export(model, tmp_path, max_shard_bytes=64 * 1024)
    assert summary.shards > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    tokens = torch.arange(10).view(1, 10)
    with torch.no_grad():
        assert (model(tokens)[0] - load_hf(tmp_path)(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(qk_norm=True, shared_expert_hidden=24, router=dict(top_k=2)), "softmax gating + shared expert"),
    (dict(qk_norm=True, router=dict(top_k=2, expert_bias=True)), "router.expert_bias=True with softmax"),
    (dict(dense_layers=[1], router=dict(gating="sigmoid", top_k=2)), "dense_layers=[1] with sigmoid"),
    (dict(shared_expert_hidden=36, router=dict(gating="sigmoid", top_k=2)), "shared_expert_hidden=36"),
    (dict(qk_norm=True, router=dict(top_k=2, routing="random")), "router.routing='random'"),
])
def test_unsupported_features_are_refused_by_name(overrides, message, tmp_path):
    model = make_model(**overrides)
    with pytest.raises(HFConversionError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("+", r"\+")):
        export(model, tmp_path)


def test_benchmark_routing_exports_when_allowed(tmp_path):
    model = make_model(qk_norm=True, router=dict(top_k=2, routing="uniform"))
    assert export(model, tmp_path, allow_benchmark_routing=True).architecture == "Qwen3MoeForCausalLM"


def test_missing_source_tensor_and_wrong_shape_are_named(tmp_path):
    model = make_model(**VARIANTS["qwen3_moe"])
    state = model.state_dict()
    m = dataclasses.asdict(model.cfg)
    partial = {k: v for k, v in state.items() if k != "blocks.2.mlp.experts.w_down"}
    with pytest.raises(HFConversionError, match="blocks.2.mlp.experts.w_down"):
        export_hf_folder(m, partial, tmp_path)
    bad = dict(state)
    bad["blocks.0.attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(HFConversionError, match=r"blocks.0.attn.q_proj.weight has shape \[3, 3\], expected \[48, 48\]"):
        export_hf_folder(m, bad, tmp_path)


def test_a_failed_export_leaves_the_previous_one_intact_and_foreign_folders_are_refused(tmp_path):
    """The folder is written under a temporary name and renamed at the end: a failure midway
    (here a tensor missing from the source) leaves the previous export loadable; a folder with
    files that are not an export of ours is refused before anything is written."""
    model = make_model()
    out = tmp_path / "hf"
    export(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    partial = dict(model.state_dict())
    partial.pop(sorted(k for k in partial if "experts" in k)[-1])
    with pytest.raises(HFConversionError, match="tensor source has no tensor"):
        export_hf_folder(dataclasses.asdict(model.cfg), partial, out, dtype="fp32")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left behind
    export(make_model(seed=1), out)  # a previous export of ours is replaced whole
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(HFConversionError, match=r"holds files that are not a Hugging Face export of ours \(notes.txt\)"):
        export(model, out)
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(HFConversionError, match="is a file"):
        export(model, out / "notes.txt")


ODD_VARIANTS = {  # shapes the variants above do not reach; every one a valid config
    "d200_head_dim_32": dict(d_model=200, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, expert_hidden=40,
                             tie_embeddings=True, router=dict(top_k=2)),
    "one_expert": dict(qk_norm=False, num_experts=1, dense_layers=[2], router=dict(top_k=1, normalize_top_k=False)),
    "top_k_all_experts": dict(qk_norm=True, num_layers=2, dense_layers=[0, 1], shared_expert_hidden=24,
                              router=dict(gating="sigmoid", top_k=6, expert_bias=True)),
    "every_layer_dense": dict(qk_norm=True, num_layers=2, dense_layers=[0, 1], router=dict(top_k=2)),
}


@pytest.mark.parametrize("variant", list(ODD_VARIANTS))
def test_odd_but_valid_configs_export_to_folders_transformers_computes_exactly(variant, tmp_path):
    model = make_model(**ODD_VARIANTS[variant])
    out = tmp_path / "not" / "yet" / "there"  # the parents are created
    export(model, out)
    hf = load_hf(out)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(tokens)[0] - hf(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("value", "dtype", "count"), [(float("nan"), "fp32", 1), (float("inf"), "bf16", 1),
                                                      (3.4e38, "bf16", 1)])
def test_non_finite_weights_are_refused_and_the_previous_export_is_kept(value, dtype, count, tmp_path):
    """Before: a diverged checkpoint (or an fp32 value past bf16's range, 3.4e38 -> inf) exported without a
    word, and transformers then produced NaN logits."""
    model = make_model(**VARIANTS["qwen3_moe"])
    out = tmp_path / "hf"
    export(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    state = dict(model.state_dict())
    w = state["blocks.2.mlp.experts.w_down"].clone()
    w[3, 5, 7] = value
    state["blocks.2.mlp.experts.w_down"] = w
    with pytest.raises(HFConversionError, match=rf"tensor blocks.2.mlp.experts.w_down \(exported as "
                                                rf"model.layers.2.mlp.experts.3.down_proj.weight, .*\) holds {count} "
                                                r"NaN / Inf values of 1152: expected finite weights"):
        export_hf_folder(dataclasses.asdict(model.cfg), state, out, dtype=dtype)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_a_missing_tokenizer_is_refused_before_any_tensor_is_read(tmp_path):
    """Before: every shard was converted and written (minutes for a large model), then the export failed."""
    model = make_model(**VARIANTS["qwen3_moe"])
    state, read = model.state_dict(), []

    def source(name: str) -> torch.Tensor:
        read.append(name)
        return state[name]

    with pytest.raises(HFConversionError, match=r"tokenizer_json='.*nowhere.json' is not a file"):
        export_hf_folder(dataclasses.asdict(model.cfg), source, tmp_path / "hf",
                         tokenizer_json=tmp_path / "nowhere.json")
    assert read == [] and list(tmp_path.iterdir()) == []


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def _folder(path, content: str = "x"):
    path.mkdir()
    (path / "model.safetensors").write_text(content)
    return path


def test_leftovers_of_killed_exports_to_the_same_folder_are_removed_and_nothing_else(tmp_path):
    """A killed export leaves `.hf.tmp-PID-XXXXXXXX` (a partial folder) and, killed after moving the previous
    export aside, `.hf.old-PID-XXXXXXXX`; moe-ckpt <= 0.4.1 named them without the pid. The next export to
    `hf` removes those of exited processes; a running process's folders, other exports' names, near-misses,
    files and symlinks stay."""
    model = make_model()
    out, dead, alive = tmp_path / "hf", _dead_pid(), os.getppid()
    export(model, out)
    target = _folder(tmp_path / "target")
    removed = [_folder(tmp_path / n) for n in (f".hf.tmp-{dead}-0123abcd", f".hf.old-{dead}-89abcdef",
                                                ".hf.tmp-deadbeef", ".hf.old-00c0ffee")]
    kept = [_folder(tmp_path / n) for n in (f".hf.tmp-{alive}-0123abcd", f".hf.old-{os.getpid()}-0123abcd",
                                             f".hf2.tmp-{dead}-0123abcd", f"hf.tmp-{dead}-0123abcd",
                                             f".hf.tmp-{dead}-0123abcd.bak", ".hf.tmp-0123ABCD", ".hf.tmp-0-0123abcd",
                                             f".hf.tmp-{dead}-0123abc", ".hf.old-xyz", ".hf.tmp-deadbeef-")]
    (tmp_path / f".hf.old-{dead}-11111111").write_text("a file, not a folder of ours")
    (tmp_path / f".hf.tmp-{dead}-22222222").symlink_to(target, target_is_directory=True)
    export(make_model(seed=1), out)
    assert not any(p.exists() for p in removed)
    assert all((p / "model.safetensors").read_text() == "x" for p in [*kept, target])
    assert (tmp_path / f".hf.old-{dead}-11111111").is_file()
    assert (tmp_path / f".hf.tmp-{dead}-22222222").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == [".moe_ckpt_export", "config.json", "generation_config.json",
                                                      "model.safetensors"]


def test_a_previous_export_moved_aside_by_a_killed_export_is_restored_with_a_warning(tmp_path):
    """Killed between its two renames, an export leaves no `hf` and the previous export in `.hf.old-PID-X`.
    The next export renames it back (warning that it did), so that if this export fails too the previous one
    is in place, and if it succeeds it replaces it as usual; older moved-aside copies and the partial folder go."""
    model = make_model()
    out, dead = tmp_path / "hf", _dead_pid()
    export(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    os.rename(out, tmp_path / f".hf.old-{dead}-0123abcd")
    older = _folder(tmp_path / ".hf.old-00c0ffee")
    os.utime(older, (1, 1))
    _folder(tmp_path / f".hf.tmp-{dead}-89abcdef")
    partial = dict(model.state_dict())
    partial.pop(sorted(k for k in partial if "experts" in k)[-1])
    with pytest.warns(UserWarning, match=rf"out_dir was missing and \.hf\.old-{dead}-0123abcd beside it held the "
                                         r"previous export, .* restored it to hf"):
        with pytest.raises(HFConversionError, match="tensor source has no tensor"):
            export_hf_folder(dataclasses.asdict(model.cfg), partial, out, dtype="fp32")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    export(make_model(seed=1), out)
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_a_moved_aside_export_of_a_running_process_is_left_alone(tmp_path):
    """Its export is between its two renames right now: its folder is neither restored nor removed."""
    model = make_model()
    aside = _folder(tmp_path / f".hf.old-{os.getppid()}-0123abcd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "restored" warning
        export(model, tmp_path / "hf")
    assert (aside / "model.safetensors").read_text() == "x"
