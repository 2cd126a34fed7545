"""Read a Hugging Face model folder back into our config dict and our tensors, one tensor at a time.

`open_hf_folder` checks config.json and every tensor name and shape (from safetensors headers,
nothing loaded) before it returns; `HFFolder.tensors()` then streams our fp32 tensors by our names.
A GLM-4-MoE folder's multi-token-prediction layers are left out, as transformers leaves them out, with a
warning naming them (`HFFolder.dropped`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moe_ckpt.hf.custom_code import from_custom_config
from moe_ckpt.hf.layout import Entry, build_plan, from_hf
from moe_ckpt.hf.refusals import ARCH, HFConversionError
from moe_ckpt.hf.spec import CUSTOM_ARCH, CUSTOM_MODEL_TYPE, from_hf_config, head_dim, mtp_layers


@dataclass
class HFFolder:
    """A checked HF folder. model_config: our model fields (router as a nested dict); extra_config: token ids etc.;
    dropped: the folder's tensors left out (GLM-4-MoE's multi-token-prediction layers), sorted."""

    folder: Path
    model_type: str
    model_config: dict[str, Any]
    extra_config: dict[str, Any]
    plan: list[Entry]
    files: dict[str, str]  # HF tensor name -> safetensors file name
    dropped: tuple[str, ...] = ()
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)

    def _read(self, name: str) -> torch.Tensor:
        fname = self.files[name]
        if fname not in self._handles:
            self._handles[fname] = open_safetensors(self.folder / fname)
        return self._handles[fname].get_tensor(name).float()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, fp32 tensor) for every tensor of our state dict; lm_head.weight aliases embed when tied."""
        try:
            for entry in self.plan:
                ours = from_hf(entry, [self._read(name) for name, _ in entry.hf])
                if ours is None:
                    continue
                assert entry.ours is not None
                yield entry.ours, ours
                if entry.ours == "embed.weight" and self.model_config["tie_embeddings"]:
                    yield "lm_head.weight", ours
        finally:
            self._handles.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors())


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; HFConversionError naming the file otherwise."""
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConversionError(f"{path} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise HFConversionError(f"{path} holds a JSON {type(obj).__name__}, expected an object")
    return obj


def open_safetensors(path: Path):
    """safe_open, with an unreadable (truncated, foreign) file reported as HFConversionError naming it."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors' own error type
        raise HFConversionError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def _index_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (tensor name -> shard file), checked."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise HFConversionError(f"{index} has no 'weight_map' object (tensor name -> shard file)")
    bad = sorted({str(f) for f in weight_map.values()
                  if not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..")})
    if bad:
        raise HFConversionError(f"{index} names shard files {bad[:3]} outside the folder; expected plain file names")
    return dict(weight_map)


def _index_names_only(index: Path, name: str) -> bool:
    """Whether the index maps every tensor to file `name` (one layout, described twice); a damaged index does not."""
    try:
        return set(_index_map(index).values()) == {name}
    except (HFConversionError, ValueError, OSError):  # ignored anyway: model.safetensors is what is read
        return False


def _tensor_files(folder: Path) -> dict[str, str]:
    """Tensor name -> file, from the files transformers would load: model.safetensors when the folder has one (its
    loader looks for it first), else the index's shards."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if single.is_file() and index.is_file() and not _index_names_only(index, single.name):
        warnings.warn(f"{str(folder)!r} holds both model.safetensors and model.safetensors.index.json: reading "
                      "model.safetensors, the one transformers loads (the index and its shards are ignored; delete "
                      "the layout you do not mean)", stacklevel=3)
    if index.is_file() and not single.is_file():
        return _index_map(index)
    if not single.is_file():
        raise HFConversionError(f"{str(folder)!r} has neither model.safetensors nor model.safetensors.index.json")
    with open_safetensors(single) as f:
        return {k: "model.safetensors" for k in f.keys()}


def _shapes(folder: Path, files: dict[str, str]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Every tensor's shape, from the headers of the files `files` names, and the file that holds it."""
    shapes: dict[str, tuple[int, ...]] = {}
    held_in: dict[str, str] = {}
    for fname in sorted(set(files.values())):
        path = folder / fname
        if not path.is_file():
            raise HFConversionError(f"shard {fname} named by the index is missing from {str(folder)!r}")
        with open_safetensors(path) as f:
            for k in f.keys():
                shapes[k] = tuple(f.get_slice(k).get_shape())
                held_in.setdefault(k, fname)
    return shapes, held_in


def _check_weight_map(folder: Path, files: dict[str, str], held_in: dict[str, str], name: str) -> None:
    """The index's file for tensor `name` (which a shard holds) must be one that holds it: tensors are read by
    the index, as transformers reads them (a tensor the index leaves out is one transformers never loads)."""
    index = folder / "model.safetensors.index.json"
    if name not in files:
        raise HFConversionError(f"{index} does not list tensor {name}, which {held_in[name]} holds; "
                                "add it to the weight_map")
    if files[name] != held_in[name]:
        with open_safetensors(folder / files[name]) as f:
            if name in f.keys():
                return
        raise HFConversionError(f"{index} maps tensor {name} to {files[name]}, which does not hold it; "
                                f"{held_in[name]} does")


def _attention_defaults_hint(name: str, hf_config: dict[str, Any], model_config: dict[str, Any]) -> str:
    """For an attention tensor of the wrong shape: the head keys config.json leaves out, and what was assumed
    for them (transformers' class defaults differ by model and version: Qwen3's head_dim is 128)."""
    missing = [key for key in ("head_dim", "num_key_value_heads") if hf_config.get(key) is None]
    if ".self_attn." not in name or not missing:
        return ""
    taken = {"head_dim": f"hidden_size // num_attention_heads = {head_dim(model_config)}",
             "num_key_value_heads": f"num_attention_heads = {model_config['num_kv_heads']}"}
    return (f"; config.json has no {' or '.join(missing)}, taken as " + ", ".join(taken[k] for k in missing)
            + ": add the key(s) with the values the weights were made with")


_TIED_HEAD = "lm_head.weight"
_ROWS_PER_COMPARE = 4096  # the tied-head check compares this many vocabulary rows at a time, not two whole matrices


def _tied_head_copy(folder: Path, files: dict[str, str], held_in: dict[str, str],
                    shapes: dict[str, tuple[int, ...]], model_config: dict[str, Any], embed_name: str) -> set[str]:
    """{"lm_head.weight"} when a tied-embedding folder also stores the head (some save_pretrained calls write both)
    and it equals the embedding `embed_name` (model.embed_tokens.weight; a custom-code folder's model.embed.weight):
    the same model, the copy is skipped. A head that differs is refused: transformers 5 then unties the two (a
    different model from the config's) and transformers 4 ties them."""
    if not model_config["tie_embeddings"] or _TIED_HEAD not in shapes:
        return set()
    _check_weight_map(folder, files, held_in, _TIED_HEAD)
    if shapes[_TIED_HEAD] != shapes[embed_name]:
        raise HFConversionError(f"tensor {_TIED_HEAD} has shape {list(shapes[_TIED_HEAD])}, expected "
                                f"{list(shapes[embed_name])} (that of {embed_name}: config.json has "
                                "tie_word_embeddings=true)")
    with open_safetensors(folder / files[_TIED_HEAD]) as h, open_safetensors(folder / files[embed_name]) as e:
        head, embed = h.get_slice(_TIED_HEAD), e.get_slice(embed_name)
        for start in range(0, shapes[embed_name][0], _ROWS_PER_COMPARE):
            rows = slice(start, start + _ROWS_PER_COMPARE)
            a, b = head[rows].float(), embed[rows].float()
            if not torch.equal(a, b):
                raise HFConversionError(
                    f"config.json has tie_word_embeddings=true, but the folder's {_TIED_HEAD} differs from "
                    f"{embed_name} (max |difference| {(a - b).abs().max().item():.3g}, from row {start}): "
                    "transformers 5 loads such a folder untied and transformers 4 ties it, so which model it holds "
                    "is ambiguous. Set "
                    f"tie_word_embeddings to false to import {_TIED_HEAD} as its own head, or remove {_TIED_HEAD} "
                    "from the folder to import the tied model")
    return {_TIED_HEAD}


def open_hf_folder(folder: str | Path) -> HFFolder:
    """Check config.json and every tensor (names, shapes); raise HFConversionError naming the first problem."""
    root = Path(folder)
    cfg_path = root / "config.json"
    expected = "expected a Hugging Face model folder (config.json and *.safetensors)"
    if not root.exists():
        raise HFConversionError(f"{str(root)!r} does not exist; {expected}")
    if not root.is_dir():
        raise HFConversionError(f"{str(root)!r} is a file, not a folder; {expected}")
    if not cfg_path.is_file():
        raise HFConversionError(f"{str(root)!r} has no config.json; {expected}")
    hf_config = read_json_object(cfg_path)
    if "model_type" not in hf_config and isinstance(hf_config.get("model"), dict):
        raise HFConversionError(f"{cfg_path} is moe-train's own config (a 'model' section, no model_type): the folder "
                                "is an import-hf output or a run, already in moe-train's names, not a Hugging Face "
                                "folder; export-hf makes one of it, train.init_from trains from it")
    custom = hf_config.get("model_type") == CUSTOM_MODEL_TYPE  # our own modeling code (custom_code=True export)
    try:
        model_config, extra = from_custom_config(hf_config) if custom else from_hf_config(hf_config)
    except KeyError as e:
        raise HFConversionError(f"{cfg_path} has no {e}; expected a transformers config.json of one of "
                                f"{', '.join(ARCH)}, or {CUSTOM_MODEL_TYPE}") from None
    model_type = hf_config["model_type"]
    expected_arch = CUSTOM_ARCH if custom else ARCH[model_type]
    arch = (hf_config.get("architectures") or [expected_arch])[0]
    if arch != expected_arch:
        raise HFConversionError(f"config.json architectures={[arch]}: expected [{expected_arch!r}] for {model_type}")
    plan = build_plan(model_config, model_type)
    files = _tensor_files(root)
    shapes, held_in = _shapes(root, files)
    expected = {name: shape for e in plan for name, shape in e.hf}
    for name, shape in expected.items():
        if name not in shapes:
            raise HFConversionError(f"tensor {name} (shape {list(shape)}) is missing from {str(root)!r}")
        _check_weight_map(root, files, held_in, name)
        if shapes[name] != shape:
            raise HFConversionError(
                f"tensor {name} has shape {list(shapes[name])}, expected {list(shape)} from config.json"
                + _attention_defaults_hint(name, hf_config, model_config))
    embed = next(name for e in plan if e.ours == "embed.weight" for name, _ in e.hf)
    tied_copy = _tied_head_copy(root, files, held_in, shapes, model_config, embed)
    mtp_prefixes = tuple(f"model.layers.{i}." for i in mtp_layers(hf_config))
    dropped = sorted(name for name in set(shapes) - set(expected) if name.startswith(mtp_prefixes))
    unexpected = sorted(set(shapes) - set(expected) - set(dropped) - tied_copy)
    if unexpected:
        raise HFConversionError(
            f"tensor {unexpected[0]} (shape {list(shapes[unexpected[0]])}) has no counterpart in moe-train "
            f"({len(unexpected)} unexpected tensors in all)")
    if dropped:
        layers = ", ".join(f"{p}*" for p in mtp_prefixes if any(name.startswith(p) for name in dropped))
        many = len(mtp_prefixes) > 1
        warnings.warn(
            f"import of {str(root)!r}: dropped {len(dropped)} tensors of the multi-token-prediction "
            f"layer{'s' * many} {layers} (num_nextn_predict_layers={len(mtp_prefixes)}): transformers does not load "
            "them either and moe-train has no MTP head, so the imported model and its exports predict the next token "
            "only", UserWarning, stacklevel=2)
    return HFFolder(root, model_type, model_config, extra, plan, files, tuple(dropped))
