"""Write a Hugging Face model folder shard by shard from a tensor source.

The source yields our global tensors by name (a Mapping such as a state_dict, or a callable that
loads one tensor from a checkpoint). Shards are assigned from the plan's shapes before any tensor
is read, so at most one shard (in the output dtype) plus the tensor being converted is in memory.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from safetensors.torch import save_file

from moe_ckpt import __version__
from moe_ckpt.hf.custom_code import REMOTE_CODE_FILES, to_custom_config, write_remote_code
from moe_ckpt.hf.folder_swap import write_folder_whole
from moe_ckpt.hf.layout import Entry, build_plan, to_hf
from moe_ckpt.hf.load import read_json_object
from moe_ckpt.hf.refusals import ARCH, HFConversionError
from moe_ckpt.hf.spec import CUSTOM_ARCH, CUSTOM_MODEL_TYPE, DTYPES, choose_model_type, to_hf_config

TensorSource = Union[Mapping[str, torch.Tensor], Callable[[str], torch.Tensor]]
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHARD_BYTES = 4 * 2**30
GROUPED_MM_ROW_BYTES = 16  # torch's grouped_mm (transformers' default MoE experts kernel) needs row strides of this


@dataclass(frozen=True)
class ExportSummary:
    folder: Path
    architecture: str
    num_tensors: int
    total_bytes: int
    shards: int
    seconds: float


def tensor_getter(source: TensorSource) -> Callable[[str], torch.Tensor]:
    """A Mapping or a callable -> a callable name -> tensor that raises HFConversionError naming a missing tensor."""
    if not isinstance(source, Mapping) and not callable(source):  # a list failed as "'list' object is not callable"
        raise TypeError(f"tensor source is a {type(source).__name__}, expected a Mapping of our tensor names to "
                        "tensors (e.g. model.state_dict()) or a callable name -> tensor")

    def get(name: str) -> torch.Tensor:
        try:
            t = source[name] if isinstance(source, Mapping) else source(name)
        except KeyError:
            raise HFConversionError(f"tensor source has no tensor {name!r}") from None
        if not isinstance(t, torch.Tensor):  # a numpy array or None failed on .shape / .detach, naming no tensor
            raise TypeError(f"tensor source gave a {type(t).__name__} for {name!r}, expected a torch.Tensor")
        return t
    return get


def _assign_shards(plan: list[Entry], dtype: str, max_shard_bytes: int) -> tuple[list[int], int]:
    """Shard index per HF tensor (plan order) and the total byte count."""
    shard, used, total, out = 0, 0, 0, []
    for entry in plan:
        for _, shape in entry.hf:
            n = torch.Size(shape).numel() * (4 if entry.keep_fp32 or dtype == "fp32" else 2)
            if used and used + n > max_shard_bytes:
                shard, used = shard + 1, 0
            out.append(shard)
            used += n
            total += n
    return out, total


def _shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def export_hf_folder(
    model_config: dict[str, Any],
    source: TensorSource,
    out_dir: str | Path,
    *,
    dtype: str = "bf16",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer_json: str | Path | None = None,
    extra_config: dict[str, Any] | None = None,
    allow_benchmark_routing: bool = False,
    custom_code: bool = False,
) -> ExportSummary:
    """Write config.json, model*.safetensors (+ index), generation_config.json and tokenizer files.

    model_config: moe-train's Config.to_dict()["model"]; source: our global tensors by our names.
    extra_config: max_position_embeddings / bos_token_id / eos_token_id / pad_token_id for config.json.
    custom_code: write moe-train's own modeling code into the folder (architecture MoeTrainForCausalLM, loaded with
    trust_remote_code=True) instead of mapping onto a stock class: any valid model exports, also those no stock
    class computes.

    The folder is written whole under a temporary name beside out_dir and renamed into place at
    the end: a failure leaves out_dir as it was. An existing out_dir is replaced only when it is
    empty or holds nothing but a previous export's files; anything else is refused up front.
    What killed exports to the same out_dir left beside it is cleaned up first (`folder_swap`).
    """
    if dtype not in DTYPES:
        raise HFConversionError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise HFConversionError(f"max_shard_bytes={max_shard_bytes!r}: expected a number of bytes, an integer >= 1")
    if not isinstance(model_config, Mapping):  # None failed on `.get` deep inside choose_model_type
        raise TypeError(f"model_config is a {type(model_config).__name__}, expected moe-train's model config as a dict "
                        "(Config.to_dict()['model'])")
    start = time.perf_counter()
    try:
        model_type = choose_model_type(model_config, allow_benchmark_routing, custom_code)
        hf_config = (to_custom_config(model_config, dtype, extra_config) if custom_code
                     else to_hf_config(model_config, model_type, dtype, extra_config))
        plan = build_plan(model_config, model_type)
    except KeyError as e:
        raise HFConversionError(f"model_config has no {e}: expected moe-train's model config as a dict "
                                "(Config.to_dict()['model'])") from None
    _refuse_unread_tensors(source, plan, model_config)
    if not custom_code:  # the custom modeling file runs its experts as plain matmuls
        _warn_unaligned_experts(model_config, dtype, out_dir)
    shard_of, total = _assign_shards(plan, dtype, max_shard_bytes)
    n_shards = shard_of[-1] + 1
    if tokenizer_json is not None and not Path(tokenizer_json).is_file():  # before any shard is written
        raise HFConversionError(f"tokenizer_json={str(tokenizer_json)!r} is not a file; "
                                "expected a tokenizers tokenizer.json")
    if tokenizer_json is not None:
        _added_tokens(Path(tokenizer_json))  # a damaged file fails here too, not after every shard is written
        _check_tokenizer_fits(Path(tokenizer_json), model_config["vocab_size"])
    # A link to a folder is written through (write_folder_whole): the export replaces the folder it points to and
    # the link stays. Renaming the link itself aside would put the export where the link is and leave the link
    # behind as a leftover no later export removes.
    num_tensors = write_folder_whole(
        out_dir, lambda out: _write_folder(out, plan, shard_of, n_shards, total, source, dtype, hf_config,
                                           tokenizer_json),
        check=_check_replaceable, what="export")
    arch = CUSTOM_ARCH if model_type == CUSTOM_MODEL_TYPE else ARCH[model_type]
    return ExportSummary(Path(out_dir), arch, num_tensors, total, n_shards, time.perf_counter() - start)


def _refuse_unread_tensors(source: TensorSource, plan: list[Entry], model_config: dict[str, Any]) -> None:
    """A state dict holding tensors the config's plan never reads was made for another config (more layers, a
    shared expert, biases, an untied head): exporting it would silently drop those weights and write another
    model. Refused before anything is written. A tied model's lm_head.weight is read as embed.weight, so it must
    equal it. A callable source cannot be listed: its reader checks its own names."""
    if not isinstance(source, Mapping):
        return
    unread = sorted(set(source) - {e.ours for e in plan if e.ours is not None})
    if model_config.get("tie_embeddings") and "lm_head.weight" in unread and "embed.weight" in source:
        unread.remove("lm_head.weight")
        if not torch.equal(source["lm_head.weight"], source["embed.weight"]):
            raise HFConversionError("tensor source's lm_head.weight differs from its embed.weight, but the model "
                                    "config has tie_embeddings=True: the export writes one of them for both; expected "
                                    "equal tensors (or tie_embeddings=False)")
    if unread:
        raise HFConversionError(
            f"tensor source has {len(unread)} tensors the model config does not describe, e.g. {unread[:3]} "
            f"(num_layers={model_config.get('num_layers')}, num_experts={model_config.get('num_experts')}): the "
            "weights were made for another config, and exporting would drop them; expected the config they were "
            "trained with")


def _warn_unaligned_experts(model_config: dict[str, Any], dtype: str, out_dir: str | Path) -> None:
    """Expert weight rows hold d_model (gate/up) or expert_hidden (down) elements. When a row is not a
    multiple of 16 bytes in the export dtype or in bf16, transformers loads the folder and then its
    grouped_mm fails on the first forward ("strides should be multiple of 16 bytes"): warn, naming them."""
    if not model_config.get("num_experts"):
        return
    sizes = {"model.d_model": model_config["d_model"], "model.expert_hidden": model_config["expert_hidden"]}
    bad = [f"{name}={n} ({n * TORCH_DTYPES[dt].itemsize} bytes per {dt} row)"
           for name, n in sizes.items() for dt in dict.fromkeys([dtype, "bf16"])
           if n * TORCH_DTYPES[dt].itemsize % GROUPED_MM_ROW_BYTES]
    if bad:
        warnings.warn(
            f"export to {str(out_dir)!r}: expert weight rows are not a multiple of {GROUPED_MM_ROW_BYTES} bytes: "
            f"{', '.join(bad)}. transformers loads the folder, but its default MoE kernel (grouped_mm) fails on the "
            "first forward in that dtype ('strides should be multiple of 16 bytes'); load it with "
            "experts_implementation='eager', or train with d_model and expert_hidden multiples of 8",
            UserWarning, stacklevel=3)


# Written into every export: an existing out_dir is replaced only when it holds it (or nothing). A folder of the same
# file names without it (a model downloaded from the Hub, an export by another tool, or ours before moe-ckpt 0.15.2)
# is someone else's and is refused, not replaced.
EXPORT_MARKER = ".moe_ckpt_export"
_EXPORT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "model.safetensors.index.json", EXPORT_MARKER, *REMOTE_CODE_FILES)


def _is_export_file(name: str) -> bool:
    return name in _EXPORT_FILES or (name.startswith("model-") and name.endswith(".safetensors"))


def _check_replaceable(final: Path) -> None:
    if not final.exists():
        return
    if not final.is_dir():
        raise HFConversionError(f"out_dir={str(final)!r} is a file; expected a folder to write the export into")
    held = sorted(final.iterdir())
    foreign = [p.name for p in held if not (p.is_file() and _is_export_file(p.name))]
    if foreign:
        raise HFConversionError(
            f"out_dir={str(final)!r} holds files that are not a Hugging Face export of ours "
            f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); export into an empty or new folder"
        )
    if held and not (final / EXPORT_MARKER).is_file():
        raise HFConversionError(
            f"out_dir={str(final)!r} holds a Hugging Face model folder ({', '.join(p.name for p in held[:5])}"
            f"{', ...' if len(held) > 5 else ''}) that no export of ours wrote (it has no {EXPORT_MARKER}: a downloaded "
            "model, another tool's export, or ours before moe-ckpt 0.15.2), so it is not replaced; export into an empty "
            "or new folder, or remove that one first")


def _write_folder(out, plan, shard_of, n_shards, total, source, dtype, hf_config, tokenizer_json) -> int:
    get, weight_map, pending, current, k = tensor_getter(source), {}, {}, 0, 0
    for entry in plan:
        ours = None
        if entry.ours is not None:
            ours = get(entry.ours)
            if tuple(ours.shape) != entry.our_shape:
                raise HFConversionError(
                    f"tensor {entry.ours} has shape {list(ours.shape)}, expected {list(entry.our_shape)} from the config")
        for (name, _), t in zip(entry.hf, to_hf(entry, ours)):
            if shard_of[k] != current:
                _write_shard(out, pending, current, n_shards)
                pending, current = {}, shard_of[k]
            target = torch.float32 if entry.keep_fp32 else TORCH_DTYPES[dtype]
            pending[name] = _check_finite(t.detach().to("cpu", target).contiguous(), name, entry.ours,
                                          halved_source=ours if entry.kind == "double" else None)
            weight_map[name] = _shard_name(current, n_shards)
            k += 1
        del ours
    _write_shard(out, pending, current, n_shards)
    if n_shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    _write_generation_config(out, hf_config)
    if tokenizer_json is not None:
        write_tokenizer(out, tokenizer_json, hf_config)
    if hf_config["model_type"] == CUSTOM_MODEL_TYPE:
        write_remote_code(out)
    (out / EXPORT_MARKER).write_text(f"written by moe-ckpt {__version__} export_hf_folder; a later export may replace "
                                     "this folder\n")
    return len(weight_map)


def _check_finite(t: torch.Tensor, name: str, ours: str | None, halved_source: torch.Tensor | None = None) -> torch.Tensor:
    """A NaN or Inf weight (or an fp32 value past the export dtype's range) gives NaN logits in transformers.
    halved_source: our tensor when the export stores it doubled (an ungated shared expert's down projection, whose
    gate is pinned at 0.5), so a finite weight past half the dtype's range is named as such."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        if halved_source is not None and bool(torch.isfinite(halved_source).all()):
            raise HFConversionError(
                f"tensor {ours} is exported doubled as {name} (the shared expert's gate is pinned at 0.5, so its down "
                f"projection is stored x2), and {int(bad.sum())} of its {t.numel()} doubled values are beyond "
                f"{t.dtype}'s range; export in bf16 or fp32, which hold them")
        raise HFConversionError(
            f"tensor {ours or name} (exported as {name}, {t.dtype}) holds {int(bad.sum())} NaN / Inf values of "
            f"{t.numel()}: expected finite weights (a diverged checkpoint, or values beyond {t.dtype}'s range); "
            "export an earlier checkpoint")
    return t


def _write_shard(out: Path, tensors: dict[str, torch.Tensor], i: int, n: int) -> None:
    save_file(tensors, str(out / _shard_name(i, n)), metadata={"format": "pt"})


def _write_generation_config(out: Path, hf_config: dict[str, Any]) -> None:
    gen: dict[str, Any] = {"_from_model_config": True}
    gen.update({k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config.get(k) is not None})
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def write_tokenizer(out: Path, tokenizer_json: str | Path, hf_config: dict[str, Any]) -> None:
    """Copy tokenizer.json and write a tokenizer_config.json that AutoTokenizer loads (fast tokenizer)."""
    src = Path(tokenizer_json)  # export_hf_folder checked it before writing any shard
    shutil.copyfile(src, out / "tokenizer.json")
    added = _added_tokens(src)
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": hf_config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    for key in ("bos", "eos", "pad"):
        token_id = hf_config.get(f"{key}_token_id")
        if token_id in added:
            tok_config[f"{key}_token"] = added[token_id]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")


def _largest_token_id(tokenizer_json: Path) -> int | None:
    """The largest id tokenizer.json can produce: its model's vocabulary (a {token: id} object for BPE, WordPiece
    and WordLevel, a [[token, score], ...] list for Unigram) and its added tokens; None when it lists none."""
    model = read_json_object(tokenizer_json).get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = [i for i in [*_added_tokens(tokenizer_json), *(vocab.values() if isinstance(vocab, dict) else ())]
           if isinstance(i, int)]
    if isinstance(vocab, list) and vocab:
        ids.append(len(vocab) - 1)
    return max(ids, default=None)


def _check_tokenizer_fits(tokenizer_json: Path, vocab_size: int) -> None:
    """A token id the model has no embedding row for fails in transformers on the first text that holds it
    ('index out of range in self'): refused before any shard is written."""
    largest = _largest_token_id(tokenizer_json)
    if largest is not None and largest >= vocab_size:
        raise HFConversionError(
            f"tokenizer_json={str(tokenizer_json)!r} has token ids up to {largest}, but model.vocab_size={vocab_size}: "
            f"transformers fails on any text holding an id >= {vocab_size} (index out of range); expected a tokenizer "
            f"whose ids are all below {vocab_size} (the one the model was trained with)")


def _added_tokens(tokenizer_json: Path) -> dict[int, str]:
    """tokenizer.json's added tokens by id; HFConversionError naming the file unless it is a tokenizers one."""
    added = read_json_object(tokenizer_json).get("added_tokens", [])
    if not (isinstance(added, list) and all(isinstance(t, dict) and "id" in t and "content" in t for t in added)):
        raise HFConversionError(f"{tokenizer_json}: 'added_tokens' is {json.dumps(added)[:80]}, expected a list of "
                                "{'id', 'content', ...} objects (a tokenizers tokenizer.json)")
    return {t["id"]: t["content"] for t in added}
