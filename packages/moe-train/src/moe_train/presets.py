"""Named starting configs. `get_preset(name)` returns a fresh Config."""

from __future__ import annotations

from collections.abc import Callable

from moe_train.config import Config, ConfigError, DataConfig, ModelConfig, RouterConfig, TrainConfig


def tiny() -> Config:
    """A small MoE that learns on 2 CPU cores in a few minutes."""
    return Config(
        model=ModelConfig(
            vocab_size=2048, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, qk_norm=True,
            dense_hidden=384, dense_layers=[0], num_experts=8, expert_hidden=128, shared_expert_hidden=0,
            router=RouterConfig(top_k=2),
        ),
        data=DataConfig(seq_len=128, default_vocab_size=2048, default_max_bytes=3_000_000),
        train=TrainConfig(steps=300, micro_batch_size=16, lr=3e-3, warmup_steps=30, eval_interval=50),
        preset="tiny",
    )


def olmo3_bench(num_experts: int) -> Config:
    """OLMo-core 3's 8-layer benchmark model (FACTS.md): ~3.2B active at any expert count."""
    return Config(
        model=ModelConfig(
            vocab_size=100_352, d_model=4096, num_layers=8, num_heads=32, num_kv_heads=8, qk_norm=True,
            dense_hidden=4 * 4096 + 4096, dense_layers=[0], num_experts=num_experts, expert_hidden=4096,
            shared_expert_hidden=4096, router=RouterConfig(top_k=4, routing="random"), rope_theta=500_000.0,
        ),
        data=DataConfig(seq_len=8192),
        train=TrainConfig(micro_batch_size=2, eval_windows=8),
        preset=f"olmo3-bench-e{num_experts}",
    )


def fine_grained_bench(num_experts: int) -> Config:
    """The single-H200 peer comparison shape of FACTS.md (d 2048, top-8, expert hidden 1024)."""
    return Config(
        model=ModelConfig(
            vocab_size=50_304, d_model=2048, num_layers=8, num_heads=16, num_kv_heads=8, qk_norm=True,
            dense_hidden=8192, num_experts=num_experts, expert_hidden=1024,
            router=RouterConfig(top_k=8, routing="random"),
        ),
        data=DataConfig(seq_len=4096),
        train=TrainConfig(micro_batch_size=2, eval_windows=8),
        preset=f"fine-grained-e{num_experts}",
    )


PRESETS: dict[str, Callable[[], Config]] = {"tiny": tiny}
for _e in (8, 32, 48, 64, 128):
    PRESETS[f"olmo3-bench-e{_e}"] = lambda e=_e: olmo3_bench(e)
for _e in (8, 32, 128):
    PRESETS[f"fine-grained-e{_e}"] = lambda e=_e: fine_grained_bench(e)


def get_preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"preset={name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]()
