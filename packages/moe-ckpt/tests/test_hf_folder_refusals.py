"""open_hf_folder on what is no Hugging Face folder: a path that does not exist, a file, and moe-train's own
config.json (an import-hf output imported again). Each used to be refused as "has no config.json" or, for the
import-hf output, as "model_type=None", which named neither what the path is nor the way on."""

from __future__ import annotations

import json

import pytest

from moe_ckpt.hf import HFConversionError
from moe_ckpt.hf.load import open_hf_folder


def test_a_missing_path_and_a_file_are_named_as_such(tmp_path):
    with pytest.raises(HFConversionError, match="does not exist; expected a Hugging Face model folder"):
        open_hf_folder(tmp_path / "nope")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(HFConversionError, match="is a file, not a folder"):
        open_hf_folder(tmp_path / "model.safetensors")


def test_moe_trains_own_config_is_named_with_the_way_on(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"d_model": 64}, "train": {"steps": 1}}))
    with pytest.raises(HFConversionError, match="import-hf output or a run.*export-hf makes one of it"):
        open_hf_folder(tmp_path)
