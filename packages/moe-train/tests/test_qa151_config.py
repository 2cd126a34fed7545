"""QA 151 (review helper 164's mutation audit of moe-train): configs and HF export. Each test fails on the mutant it
names and passes on the code: a bool field taking any integer (CI2); a file's preset: key winning over the preset
argument (CI5); config_from_dict dropping the preset (CI9); dense_layers past the last layer (V1); top_k ==
num_experts refused (V2); seq_len=1 (V3); ep not dividing dp (V4); a beta of 1 (V5); an odd number of rotary dims
(V8); hf_extra.json overriding an explicit extra_config (H4); the export-into-its-own-checkpoint message (H5)."""

from __future__ import annotations

import json

import pytest
from moe_train.config import Config, ConfigError, validate
from moe_train.config_io import build_config, config_from_dict, set_field
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.presets import get_preset
from test_hf_roundtrip import VARIANTS, make_model

# config_io: a bool field takes only 0/1 as integers; an explicit preset= wins over the config file's preset key.


@pytest.mark.parametrize("raw", [2, -1])
def test_a_bool_field_refuses_other_integers(raw):
    cfg = Config()
    set_field(cfg, "train.progress", 0)
    assert cfg.train.progress is False
    with pytest.raises(ConfigError, match="train.progress"):
        set_field(cfg, "train.progress", raw)


def test_the_preset_argument_wins_over_the_files_preset_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: tiny\n")
    assert build_config(None, str(f)).preset == "tiny"
    assert build_config("olmo3-bench-e8", str(f)).preset == "olmo3-bench-e8"


# validate's range checks at their boundaries.


def _cfg(**model):
    cfg = get_preset("tiny")
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def test_dense_layers_index_past_the_last_layer_is_refused():
    n = get_preset("tiny").model.num_layers
    validate(_cfg(dense_layers=[n - 1]))
    with pytest.raises(ConfigError, match="model.dense_layers"):
        validate(_cfg(dense_layers=[n]))


def test_top_k_may_equal_num_experts():
    cfg = get_preset("tiny")
    cfg.model.router.top_k = cfg.model.num_experts
    validate(cfg)
    cfg.model.router.top_k = cfg.model.num_experts + 1
    with pytest.raises(ConfigError, match="model.router.top_k"):
        validate(cfg)


def test_seq_len_one_is_refused():
    cfg = get_preset("tiny")
    cfg.data.seq_len = 2
    validate(cfg)
    cfg.data.seq_len = 1
    with pytest.raises(ConfigError, match="data.seq_len"):
        validate(cfg)


def test_config_from_dict_keeps_the_preset_name():
    assert Config().preset != "olmo3-bench-e8"
    assert config_from_dict(get_preset("olmo3-bench-e8").to_dict()).preset == "olmo3-bench-e8"


def test_ep_must_divide_dp():
    cfg = get_preset("tiny")
    cfg.parallel.dp, cfg.parallel.ep = 4, 4
    validate(cfg)
    cfg.parallel.dp = 2
    with pytest.raises(ConfigError, match="parallel.ep"):
        validate(cfg)


@pytest.mark.parametrize("name", ["beta1", "beta2"])
def test_a_beta_of_one_is_refused(name):
    cfg = get_preset("tiny")
    setattr(cfg.train, name, 0.999)
    validate(cfg)
    setattr(cfg.train, name, 1.0)
    with pytest.raises(ConfigError, match=f"train.{name}"):
        validate(cfg)


def test_an_odd_number_of_rotary_dims_is_refused():
    cfg = get_preset("tiny")
    assert cfg.model.resolved_head_dim == 32
    cfg.model.rotary_fraction = 16 / 32
    validate(cfg)
    cfg.model.rotary_fraction = 15 / 32  # exactly 15 dims: RoPE rotates pairs
    with pytest.raises(ConfigError, match="model.rotary_fraction"):
        validate(cfg)


# export_hf: extra_config given by the caller wins over the checkpoint's hf_extra.json (import-hf's record).


def test_extra_config_wins_over_hf_extra_json(tmp_path):
    model = make_model(**VARIANTS["qwen3_moe"])
    export_hf(model, tmp_path / "a", dtype="fp32", extra_config={"eos_token_id": 3, "max_position_embeddings": 256})
    import_hf(tmp_path / "a", tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "hf_extra.json").read_text())["eos_token_id"] == 3
    export_hf(tmp_path / "ckpt", tmp_path / "b", dtype="fp32", extra_config={"eos_token_id": 5})
    assert json.loads((tmp_path / "b" / "config.json").read_text())["eos_token_id"] == 5


def test_export_never_replaces_a_folder_holding_its_checkpoint(tmp_path):
    import pytest
    from moe_ckpt.hf import HFConversionError

    model = make_model(**VARIANTS["qwen3_moe"])
    export_hf(model, tmp_path / "a", dtype="fp32", extra_config={"eos_token_id": 3})
    outer = tmp_path / "outer"
    import_hf(tmp_path / "a", outer / "ckpt")
    with pytest.raises(HFConversionError, match="holds the checkpoint being exported"):
        export_hf(outer / "ckpt", outer, dtype="fp32")
    assert (outer / "ckpt" / "model.safetensors").is_file()
