"""Hugging Face export / import: folders that stock transformers loads without trust_remote_code, or, with
custom_code=True, folders shipping moe-train's own modeling code (any model; loaded with trust_remote_code=True).

    from moe_ckpt.hf import export_hf_folder, open_hf_folder
    export_hf_folder(cfg.to_dict()["model"], model.state_dict(), "out/hf", dtype="bf16")
    export_hf_folder(cfg.to_dict()["model"], model.state_dict(), "out/hf-code", custom_code=True)
    hf = open_hf_folder("out/hf")           # checks config.json, every tensor name and shape
    model.load_state_dict(dict(hf.tensors()))  # streams our fp32 tensors by our names
"""

from moe_ckpt.hf.export import DEFAULT_SHARD_BYTES, ExportSummary, TensorSource, export_hf_folder, tensor_getter
from moe_ckpt.hf.folder_swap import FolderWriteError, write_folder_whole
from moe_ckpt.hf.load import HFFolder, open_hf_folder, open_safetensors, read_json_object
from moe_ckpt.hf.refusals import ARCH, HFConversionError
from moe_ckpt.hf.spec import choose_model_type, from_hf_config, to_hf_config

__all__ = [
    "ARCH", "DEFAULT_SHARD_BYTES", "ExportSummary", "FolderWriteError", "HFConversionError", "HFFolder", "TensorSource",
    "choose_model_type", "export_hf_folder", "from_hf_config", "open_hf_folder", "open_safetensors",
    "read_json_object", "tensor_getter", "to_hf_config", "write_folder_whole",
]
