import pytest

from moe_train.config import ConfigError
from moe_train.config_io import build_config, parse_overrides
from moe_train.model import count_params

PUBLISHED_TOTAL_B = {8: 4.6, 64: 24.3, 128: 47.0}


@pytest.mark.parametrize("experts,total_b", sorted(PUBLISHED_TOTAL_B.items()))
def test_olmo3_bench_presets_match_published_parameter_counts(experts, total_b):
    counts = count_params(build_config(f"olmo3-bench-e{experts}").model)
    assert abs(counts.total / 1e9 - total_b) / total_b < 0.02
    assert abs(counts.active / 1e9 - 3.2) / 3.2 < 0.02


def test_olmo3_bench_preset_shape():
    m = build_config("olmo3-bench-e32").model
    assert (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.router.top_k) == (4096, 8, 32, 8, 4)
    assert m.dense_layers == [0] and m.dense_hidden == 20480 and m.shared_expert_hidden == 4096
    assert m.vocab_size == 100_352 and not m.tie_embeddings


def test_overrides_and_yaml_are_typed_and_applied(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("preset: tiny\nmodel:\n  num_experts: 16\n  router:\n    top_k: 4\ntrain:\n  lr: 0.001\n")
    cfg = build_config(None, str(y), parse_overrides(["--model.dense_layers=[0,1]", "--train.steps", "7",
                                                      "--model.router.gating=sigmoid"]))
    assert cfg.model.num_experts == 16 and cfg.model.router.top_k == 4 and cfg.train.lr == 0.001
    assert cfg.model.dense_layers == [0, 1] and cfg.train.steps == 7 and cfg.model.router.gating == "sigmoid"


@pytest.mark.parametrize("overrides,message", [
    (["--model.router.top_k=9"], "model.router.top_k=9: expected 1 <= top_k <= model.num_experts=8"),
    (["--model.num_kv_heads=3"], "model.num_kv_heads=3: expected a divisor of model.num_heads=4"),
    (["--model.num_expert=3"], "unknown config key 'model.num_expert'"),
    (["--train.steps=abc"], "train.steps='abc': expected an integer"),
    (["--parallel.ep=3"], "parallel.ep=3: expected a divisor of model.num_experts=8"),
    (["--model.router.gating=relu"], "model.router.gating='relu': expected one of softmax, sigmoid"),
    (["--parallel.collective_timeout_s=0"], "parallel.collective_timeout_s=0.0: expected a positive number of seconds"),
])
def test_bad_config_names_the_field(overrides, message):
    with pytest.raises(ConfigError) as e:
        build_config("tiny", None, parse_overrides(overrides))
    assert message in str(e.value)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="preset='huge': expected one of tiny, olmo3-bench-e8"):
        build_config("huge")


def test_fsdp_baseline_refuses_checkpoints_and_expert_parallelism_up_front():
    with pytest.raises(ConfigError, match="train.save_interval=100: expected 0 with parallel.strategy='fsdp'"):
        build_config("tiny", None, parse_overrides(["--parallel.strategy=fsdp"]))
    with pytest.raises(ConfigError, match="parallel.ep=2: expected 1 with parallel.strategy='fsdp'"):
        build_config("tiny", None, parse_overrides(["--parallel.strategy=fsdp", "--train.save_interval=0",
                                                    "--parallel.ep=2", "--parallel.dp=2"]))


def test_expert_parallelism_over_a_dense_model_names_the_dense_model():
    """ep=2 on num_experts=0 said 'expected a divisor of model.num_experts=0', which 2 is."""
    with pytest.raises(ConfigError, match=r"parallel.ep=2: expected 1: model.num_experts=0 is a dense model"):
        build_config("tiny", overrides={"model.num_experts": 0, "parallel.ep": 2, "parallel.dp": 2})
