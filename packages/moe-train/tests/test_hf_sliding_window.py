"""Sliding-window models (model.sliding_window_pattern) exported to Hugging Face compute our function in transformers.

A window w: the query and the w - 1 tokens before it (transformers' sliding_window: kv_idx > q_idx - w); 0 = full
causal attention. Stock classes (Qwen3: layer_types; Qwen3-MoE: every layer) and the custom-code export (any
pattern), loaded with eager and sdpa attention, give our fp32 logits on 37 tokens with windows of 1, 5 and 16;
a window one larger or smaller gives other logits (so the comparison sees an off-by-one), and a float64 reference
written out here fixes what a window means independently of both implementations. Export then import keeps the
pattern. A windowed Qwen2-MoE export is refused (its attention passes no window to flash attention), but a Qwen2-MoE
folder with windows imports: transformers' eager and sdpa logits are those of the model import_hf builds.
The config.json side: packages/moe-ckpt/tests/test_hf_sliding_window.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from moe_ckpt.hf import HFConversionError, export_hf_folder
from moe_train.config import Config, ModelConfig, validate
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_home, one_thread, our_greedy, random_model  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.usefixtures("hf_home")  # transformers' caches in a temporary folder (custom code)

BASE = dict(vocab_size=97, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, dense_hidden=40, num_experts=4,
            expert_hidden=16, init_std=0.1, rope_theta=1000.0, norm_eps=1e-5)
SEQ = 37  # longer than every window below
TOL = 1e-4  # fp32, max abs over the logits (test_hf_export.py's)

# name -> (ModelConfig overrides, the class transformers loads)
STOCK = {
    "qwen3_window_1_then_full": (dict(qk_norm=True, num_experts=0, sliding_window_pattern=[1, 0]), "Qwen3ForCausalLM"),
    "qwen3_window_5_olmo3_shape": (dict(qk_norm=True, num_experts=0, sliding_window_pattern=[5, 5, 5, 0]),
                                   "Qwen3ForCausalLM"),
    "qwen3_moe_window_5_every_layer": (dict(qk_norm=True, dense_layers=[1], sliding_window_pattern=[5],
                                            router=dict(top_k=2)), "Qwen3MoeForCausalLM"),
}
# Qwen2-MoE (q/k/v biases, a gated shared expert, a dense layer): exported without windows, its config.json given them.
QWEN2_MOE = dict(qk_norm=False, attention_bias=True, shared_expert_hidden=24, shared_expert_gate=True, dense_layers=[0],
                 router=dict(top_k=2))
SW, FA = "sliding_attention", "full_attention"
# name -> (window keys added to its config.json, the pattern import_hf reads from them)
QWEN2_MOE_WINDOWS = {
    "window_5_odd_layers": (dict(sliding_window=5, layer_types=[FA, SW, FA, SW]), [0, 5]),
    "window_16_every_layer": (dict(sliding_window=16, layer_types=[SW] * 4), [16]),
    # no layer_types: Qwen2MoeConfig slides the even layers below max_window_layers
    "window_3_even_layers_by_max_window_layers": (dict(sliding_window=3, max_window_layers=4), [3, 0]),
}
# No stock class: softmax + shared expert + QK-norm (OLMo-core 3's shape), and windows of three sizes beside full.
CUSTOM = dict(qk_norm=True, shared_expert_hidden=24, dense_layers=[0], sliding_window_pattern=[1, 5, 0, 16],
              router=dict(top_k=2))


def make_model(overrides: dict, seed: int = 3) -> Transformer:
    return random_model(BASE, overrides, seed=seed)


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def load(folder: Path, attn: str | None = None, custom: bool = False):
    kw = {"attn_implementation": attn} if attn else {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             trust_remote_code=custom, **kw).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out[0]


def with_pattern(model: Transformer, pattern: list[int]) -> tuple[dict, dict]:
    """model's config dict with another sliding_window_pattern, and its weights."""
    return {**dataclasses.asdict(model.cfg), "sliding_window_pattern": pattern}, model.state_dict()


def shifted(pattern: list[int], by: int) -> list[int]:
    """Each window moved by `by` (full attention stays full; a window stays >= 1)."""
    return [max(w + by, 1) if w else 0 for w in pattern]


@pytest.mark.parametrize("case", list(STOCK))
def test_stock_export_computes_our_windows_in_eager_and_sdpa(case, tmp_path):
    overrides, arch = STOCK[case]
    model = make_model(overrides)
    assert export_hf(model, tmp_path / "hf", dtype="fp32").architecture == arch
    ids = tokens()
    ours = logits(model, ids)
    for attn in ("eager", "sdpa"):
        hf = load(tmp_path / "hf", attn)
        assert type(hf).__name__ == arch and hf.config._attn_implementation == attn
        diff = (logits(hf, ids) - ours).abs().max().item()
        assert diff <= TOL, (attn, diff)


@pytest.mark.parametrize("case", ["qwen3_window_1_then_full", "qwen3_window_5_olmo3_shape"])
def test_a_window_one_larger_or_smaller_gives_other_logits(case, tmp_path):
    """What makes the comparisons above see an off-by-one: the same weights with each window one token larger (or
    smaller, where it is > 1) give other logits in transformers, and in our model."""
    overrides, _ = STOCK[case]
    model = make_model(overrides)
    ids = tokens()
    ours = logits(model, ids)
    pattern = model.cfg.sliding_window_pattern
    for by in (1, -1):
        other = shifted(pattern, by)
        if other == pattern:
            continue
        m, state = with_pattern(model, other)
        export_hf_folder(m, state, tmp_path / str(by), dtype="fp32")
        assert (logits(load(tmp_path / str(by), "sdpa"), ids) - ours).abs().max().item() > 100 * TOL, by
        theirs = Transformer(validate(Config(model=dataclasses.replace(model.cfg, sliding_window_pattern=other))).model)
        theirs.load_state_dict(state)
        assert (logits(theirs.eval(), ids) - ours).abs().max().item() > 100 * TOL, by


def reference_dense_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """A dense QK-norm model (Qwen3's shape) in float64, written out: RMSNorm, q/k/v, per-head QK-norm, rotate-half
    RoPE, GQA, and each layer's query q attending to the keys k with q - w < k <= q (all k <= q for w = 0)."""
    cfg, p = model.cfg, {k: v.double() for k, v in model.state_dict().items()}
    hd, seq = cfg.resolved_head_dim, ids.shape[1]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x):  # [B, H, S, hd]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    q_pos, k_pos = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    x = p["embed.weight"][ids]
    for i in range(cfg.num_layers):
        b = f"blocks.{i}"
        h = rms(x, p[f"{b}.attn_norm.weight"])
        q = (h @ p[f"{b}.attn.q_proj.weight"].T).view(*ids.shape, cfg.num_heads, hd)
        k = (h @ p[f"{b}.attn.k_proj.weight"].T).view(*ids.shape, cfg.num_kv_heads, hd)
        v = (h @ p[f"{b}.attn.v_proj.weight"].T).view(*ids.shape, cfg.num_kv_heads, hd).transpose(1, 2)
        q = rope(rms(q, p[f"{b}.attn.q_norm.weight"]).transpose(1, 2))
        k = rope(rms(k, p[f"{b}.attn.k_norm.weight"]).transpose(1, 2))
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        w = cfg.sliding_window_pattern[i % len(cfg.sliding_window_pattern)]
        allowed = (k_pos <= q_pos) & ((k_pos > q_pos - w) if w else True)
        scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        x = x + attn.transpose(1, 2).reshape(*ids.shape, -1) @ p[f"{b}.attn.o_proj.weight"].T
        h = rms(x, p[f"{b}.mlp_norm.weight"])
        gate, up = h @ p[f"{b}.mlp.gate.weight"].T, h @ p[f"{b}.mlp.up.weight"].T
        x = x + (F.silu(gate) * up) @ p[f"{b}.mlp.down.weight"].T
    return rms(x, p["norm.weight"]) @ p["lm_head.weight"].T


@pytest.mark.parametrize("case", ["qwen3_window_1_then_full", "qwen3_window_5_olmo3_shape"])
def test_transformers_and_our_model_match_a_float64_reference_of_the_window(case, tmp_path):
    """The window's meaning pinned independently of both: transformers' Qwen3 (eager and sdpa), the custom-code
    folder and our model each give the float64 reference's logits."""
    overrides, _ = STOCK[case]
    model = make_model(overrides)
    ids = tokens()
    ref = reference_dense_logits(model, ids).float()
    export_hf(model, tmp_path / "stock", dtype="fp32")
    export_hf(model, tmp_path / "custom", dtype="fp32", custom_code=True)
    runs = {"eager": load(tmp_path / "stock", "eager"), "sdpa": load(tmp_path / "stock", "sdpa"),
            "custom": load(tmp_path / "custom", custom=True), "ours": model}
    for name, run in runs.items():
        assert (logits(run, ids) - ref).abs().max().item() <= TOL, name


def test_custom_code_computes_any_pattern_in_forward_generate_and_left_padding(tmp_path):
    model = make_model(CUSTOM)
    out = tmp_path / "custom"
    assert export_hf(model, out, dtype="fp32", custom_code=True).architecture == "MoeTrainForCausalLM"
    assert json.loads((out / "config.json").read_text())["moe_train_model"]["sliding_window_pattern"] == [1, 5, 0, 16]
    hf = load(out, custom=True)
    ids = tokens()
    ours = logits(model, ids)
    assert (logits(hf, ids) - ours).abs().max().item() <= TOL

    # decoding past every window, with the cache (each step's keys cut to the window)
    prompt = ids[:1, :6]
    with torch.no_grad():
        generated = hf.generate(prompt, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(generated, our_greedy(model, prompt, 24))

    # left padding: row 1 is ids[1, :20] behind 5 pads; its real tokens compute what they compute alone
    short = ids[1:, :20]
    batch = torch.cat([ids[:1, :25], torch.cat([torch.zeros(1, 5, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    with torch.no_grad():
        padded = hf(batch, attention_mask=mask).logits
    assert (padded[1, 5:] - logits(model, short)[0]).abs().max().item() <= TOL
    assert (padded[0] - ours[0, :25]).abs().max().item() <= TOL

    cfg, state = import_hf(out)
    assert cfg.model == model.cfg and cfg.model.sliding_window_pattern == [1, 5, 0, 16]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_stock_generate_decodes_past_the_window_as_we_do(tmp_path):
    """transformers' own cache for sliding layers (it keeps window - 1 keys) decodes what our model does."""
    model = make_model(STOCK["qwen3_window_5_olmo3_shape"][0])
    export_hf(model, tmp_path, dtype="fp32")
    prompt = tokens(1, 7)
    with torch.no_grad():
        generated = load(tmp_path, "sdpa").generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                                    attention_mask=torch.ones_like(prompt))
    assert torch.equal(generated, our_greedy(model, prompt, 24))


def test_a_windowed_qwen2_moe_export_is_refused_by_name(tmp_path):
    """transformers' Qwen2MoeAttention passes no sliding_window to flash attention: that folder would compute
    another model there, so the export refuses it, naming the field and the custom-code remedy, and writes nothing."""
    model = make_model({**QWEN2_MOE, "sliding_window_pattern": [0, 5]})
    with pytest.raises(HFConversionError) as refusal:
        export_hf(model, tmp_path / "hf", dtype="fp32")
    message = str(refusal.value)
    assert "sliding_window_pattern=[0, 5]" in message, message
    assert "Qwen2MoeAttention passes no sliding_window to flash attention" in message, message
    assert "custom_code=True" in message, message
    assert not (tmp_path / "hf" / "config.json").exists()
    assert export_hf(model, tmp_path / "custom", dtype="fp32", custom_code=True).architecture == "MoeTrainForCausalLM"


def qwen2_moe_folder(model: Transformer, folder: Path, keys: dict) -> Path:
    """model (without windows) exported as Qwen2-MoE, its config.json then given use_sliding_window and `keys`."""
    assert export_hf(model, folder, dtype="fp32").architecture == "Qwen2MoeForCausalLM"
    config = json.loads((folder / "config.json").read_text())
    assert config["use_sliding_window"] is False and "layer_types" not in config
    config.update(use_sliding_window=True, **keys)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def imported(folder: Path) -> Transformer:
    cfg, state = import_hf(folder)
    model = Transformer(cfg.model)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("case", list(QWEN2_MOE_WINDOWS))
def test_transformers_computes_the_qwen2_moe_windows_we_import(case, tmp_path):
    """A Qwen2-MoE folder with windows (ours, exported without, its config.json edited): transformers' eager and
    sdpa logits on 37 tokens are those of the model import_hf builds from it, whose pattern is the folder's windows.
    The windows change the logits, and a window one larger or smaller in config.json changes transformers' logits
    (so the comparison sees an off-by-one), each again matched by its import."""
    keys, pattern = QWEN2_MOE_WINDOWS[case]
    model = make_model(QWEN2_MOE)
    ids = tokens()
    full = logits(model, ids)
    window = keys["sliding_window"]
    at: dict[int, torch.Tensor] = {}
    for w in (window, window - 1, window + 1):  # the folder's window first: the others are compared to it
        if w < 1:
            continue
        folder = qwen2_moe_folder(model, tmp_path / str(w), {**keys, "sliding_window": w})
        ours = imported(folder)
        assert ours.cfg.sliding_window_pattern == [w if x else 0 for x in pattern]
        assert all(torch.equal(ours.state_dict()[k], v) for k, v in model.state_dict().items())
        at[w] = logits(ours, ids)
        assert (at[w] - full).abs().max().item() > 100 * TOL, w  # the windows matter on these tokens
        for attn in ("eager", "sdpa"):
            hf = load(folder, attn)
            assert type(hf).__name__ == "Qwen2MoeForCausalLM" and hf.config._attn_implementation == attn
            theirs = logits(hf, ids)
            assert (theirs - at[w]).abs().max().item() <= TOL, (w, attn)
            if w != window:
                assert (theirs - at[window]).abs().max().item() > 100 * TOL, (w, attn)
    assert len(at) >= 2


def test_stock_generate_decodes_a_windowed_qwen2_moe_as_its_import_does(tmp_path):
    """transformers' cache for Qwen2-MoE's sliding layers decodes past the window what the imported model does."""
    keys, _ = QWEN2_MOE_WINDOWS["window_5_odd_layers"]
    folder = qwen2_moe_folder(make_model(QWEN2_MOE), tmp_path, keys)
    prompt = tokens(1, 7)
    with torch.no_grad():
        generated = load(folder, "sdpa").generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                                  attention_mask=torch.ones_like(prompt))
    assert torch.equal(generated, our_greedy(imported(folder), prompt, 24))


@pytest.mark.parametrize("case", list(STOCK))
def test_export_then_import_keeps_the_pattern(case, tmp_path):
    model = make_model(STOCK[case][0])
    export_hf(model, tmp_path / "hf", dtype="fp32")
    cfg, state = import_hf(tmp_path / "hf")
    assert cfg.model.sliding_window_pattern == model.cfg.sliding_window_pattern
    unused = {"expert_hidden": model.cfg.expert_hidden} if model.cfg.num_experts == 0 else {}  # a dense folder's
    assert dataclasses.replace(cfg.model, **unused) == model.cfg
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_import_replaces_the_base_configs_pattern(tmp_path):
    """import_hf lays the folder's model over a base config: a folder without windows imports without them."""
    model = make_model(dict(qk_norm=True, num_experts=0))
    export_hf(model, tmp_path / "hf", dtype="fp32")
    base = validate(Config(model=ModelConfig(sliding_window_pattern=[8, 0])))
    cfg, _ = import_hf(tmp_path / "hf", base=base)
    assert cfg.model.sliding_window_pattern == []


def test_inspect_shows_the_pattern_import_hf_wrote(tmp_path, capsys):
    """`moe-train import-hf` then `moe-train inspect` on its output: the network line names the windows, since a
    windowed and a full-attention model of one shape hold the same tensors."""
    from moe_train import cli

    model = make_model(STOCK["qwen3_window_5_olmo3_shape"][0])
    export_hf(model, tmp_path / "hf", dtype="fp32")
    assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "imported")]) == 0
    network = capsys.readouterr().out.splitlines()[1]
    assert network == ("network: num_layers=4, d_model=32, num_experts=0, vocab_size=97, "
                       "sliding_window_pattern=[5, 5, 5, 0]"), network
