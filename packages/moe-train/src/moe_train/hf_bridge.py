"""Hugging Face export / import for moe-train models and checkpoints (the CLI's export-hf / import-hf).

    export_hf("runs/tiny", "out/hf", dtype="bf16")             # a run dir, a checkpoint dir, or a Transformer
    cfg, state = import_hf("out/hf", "runs/from-hf/init")      # our Config + fp32 state dict (+ files)

A checkpoint directory is the trainer's moe-ckpt checkpoint (any layout; opened once with
`moe_ckpt.open_checkpoint` and read tensor by tensor), or `model.safetensors` (our full state dict by our
names) plus `config.json` (Config.to_dict()) or a `state.json` (whose "config" is the same). Other
layouts plug in through `register_checkpoint_reader`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi
from safetensors.torch import save_file

from moe_ckpt import LoadRequest, load_metadata, open_checkpoint
from moe_ckpt.hf import (
    ExportSummary, HFConversionError, TensorSource, choose_model_type, export_hf_folder, open_hf_folder, open_safetensors,
    read_json_object, write_folder_whole,
)
from moe_train.config import Config, ConfigError, DataConfig
from moe_train.config_io import config_from_dict, export_config_from_dict
from moe_train.data import DataError
from moe_train.data.prepare import load_tokenizer
from moe_train.data.token_file import identity_text, other_tokens, split_identity
from moe_train.model import Transformer
from moe_train.trainer import checkpoint as ckpt
from moe_train.trainer.data_setup import default_data_dir

# A reader takes a path and returns (Config.to_dict(), tensor source), or None when the layout is not its own.
# A source that holds files open is also a context manager: the export closes it when it ends.
CheckpointReader = Callable[[Path], "tuple[dict[str, Any], TensorSource] | None"]
CHECKPOINT_READERS: list[CheckpointReader] = []
HF_EXTRA_FILE = "hf_extra.json"  # token ids / max length carried from an imported folder to the next export


def register_checkpoint_reader(reader: CheckpointReader) -> None:
    """Try `reader` before the built-in model.safetensors layout (the latest registered first)."""
    CHECKPOINT_READERS.insert(0, reader)


def _resolve_checkpoint(path: Path) -> Path:
    """A run dir (or its checkpoints/ folder) resolves to its newest complete checkpoint; anything else is taken
    as given."""
    return ckpt.newest_checkpoint(path) or path


def _stored_config(path: Path, stored: dict[str, Any]) -> Config:
    """The model and tokenizer part of a checkpoint's config (export_config_from_dict), errors naming the checkpoint."""
    try:
        return export_config_from_dict(stored)
    except ConfigError as e:
        raise ConfigError(f"checkpoint {str(path)!r}: stored config: {e}") from None


class _OpenFilesSource:
    """A tensor source that reads from files held open until the export closes it (a `with` block)."""

    def __init__(self, get: Callable[[str], torch.Tensor], files: contextlib.AbstractContextManager) -> None:
        self._get, self._files = get, files

    def __call__(self, name: str) -> torch.Tensor:
        return self._get(name)

    def __enter__(self) -> _OpenFilesSource:
        return self

    def __exit__(self, *exc) -> None:
        self._files.__exit__(*exc)


def hugging_face_model_type(path: Path) -> str | None:
    """The model_type of a Hugging Face model folder (a config.json with one and no 'model' section), else None."""
    try:
        hf_config = read_json_object(path / "config.json")
    except (OSError, HFConversionError):
        return None
    return str(hf_config["model_type"]) if "model_type" in hf_config and "model" not in hf_config else None


def _hugging_face_folder_hint(path: Path) -> str:
    """The way on when `path` is a Hugging Face folder, else ''."""
    if hugging_face_model_type(path) is None:
        return ""
    return "; it is a Hugging Face folder: import-hf brings it to moe-train's names first"


def _safetensors_reader(path: Path) -> tuple[dict[str, Any], TensorSource] | None:
    weights = path / "model.safetensors"
    if not weights.is_file():
        return None
    if (path / "config.json").is_file():
        cfg = read_json_object(path / "config.json")
    elif (path / "state.json").is_file():
        cfg = read_json_object(path / "state.json").get("config")
    else:
        cfg = None
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise HFConversionError(f"checkpoint {str(path)!r}: expected config.json (Config.to_dict()) or a state.json "
                                "with a 'config' entry beside model.safetensors" + _hugging_face_folder_hint(path))
    handle = open_safetensors(weights)  # lazy: one tensor is read per call
    return cfg, _OpenFilesSource(handle.get_tensor, handle)


def _moe_ckpt_config(path: Path) -> dict[str, Any]:
    cfg = load_metadata(path).get("config")
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise HFConversionError(f"checkpoint {str(path)!r}: its metadata has no 'config' with a 'model' section")
    return cfg


def _moe_ckpt_reader(path: Path) -> tuple[dict[str, Any], TensorSource] | None:
    """The trainer's checkpoints (moe-ckpt, any layout): weights from the fp32 masters, buffers by name."""
    if not (path / "index.json").is_file():
        return None
    cfg = _moe_ckpt_config(path)
    data = cfg.get("data", {})
    if data.get("path") == "default":  # trained on the embedded corpus: export the tokenizer it made
        corpus = _stored_config(path, cfg).data
        fraction = data.get("eval_fraction")  # part of the folder's name; looked up, not validated (export needs none)
        if isinstance(fraction, (int, float)) and not isinstance(fraction, bool):
            corpus.eval_fraction = fraction
        folder = default_data_dir(corpus)
        if (folder / "meta.json").is_file():
            cfg = {**cfg, "data": {**data, "path": str(folder)}}
    ckpt = open_checkpoint(path)  # index.json parsed once; each shard file opened and checksummed once
    try:
        ckpt.check_all_files()  # a damaged file fails the export before any tensor is converted
    except BaseException:
        ckpt.close()
        raise
    names = set(ckpt.names)

    def read(name: str) -> torch.Tensor:
        stored = f"optim.{name}.master" if f"optim.{name}.master" in names else name
        if stored not in names:
            raise HFConversionError(f"checkpoint {str(path)!r} has no tensor {name!r}")
        return ckpt.read([LoadRequest(stored)])[stored]

    return cfg, _OpenFilesSource(read, ckpt)


@contextlib.contextmanager
def open_checkpoint_source(ckpt: str | Path) -> Iterator[tuple[Config, TensorSource]]:
    """(Config, lazy tensor source by our names) for a run dir or checkpoint dir, its files open inside the
    `with` block. The Config holds the stored model and tokenizer fields (export_config_from_dict); its train
    and parallel are defaults."""
    path = _resolve_checkpoint(Path(ckpt))
    for reader in [*CHECKPOINT_READERS, _moe_ckpt_reader, _safetensors_reader]:
        found = reader(path)
        if found is not None:
            cfg, source = found
            with source if isinstance(source, contextlib.AbstractContextManager) else contextlib.nullcontext():
                yield _stored_config(path, cfg), source
            return
    raise HFConversionError(f"checkpoint {str(path)!r}: no reader recognises it (expected model.safetensors + "
                            "config.json, a run dir with checkpoints/latest, or a registered reader's layout)"
                            + _hugging_face_folder_hint(path))


def stored_config(path: str | Path) -> Config:
    """The stored model and tokenizer fields of a checkpoint (as open_checkpoint_source's Config), without reading
    or checksumming its tensor files where the layout allows: a trainer checkpoint's metadata alone."""
    path = Path(path)
    if (path / "index.json").is_file():
        return _stored_config(path, _moe_ckpt_config(path))
    with open_checkpoint_source(path) as (cfg, _):
        return cfg


def _data_tokenizer(cfg: Config, checkpoint: Path) -> tuple[Path | None, dict[str, Any], str]:
    """tokenizer.json and eos id of a prepared data folder (`prepare-data` writes both), if there is one, and why
    not ("" otherwise): the folder's meta.json names a tokenizer that is not a file, or its train split holds other
    tokens than the checkpoint's record of what it trained on (a trainer checkpoint's train_data, read only when
    there is a folder to compare), so its tokenizer need not be the run's (the folder re-prepared, or a relative
    data.path taken from another directory)."""
    folder = Path(cfg.data.path)
    meta = folder / "meta.json"
    if cfg.data.path == "default" or not meta.is_file():
        return None, {}, ""
    info = json.loads(meta.read_text())
    trained_on = load_metadata(checkpoint).get("train_data") if (checkpoint / "index.json").is_file() else None
    try:
        now = split_identity(info)
    except (KeyError, TypeError):  # a meta.json without a train split's count: nothing to compare (train refuses it)
        now = None
    if now is not None and other_tokens(trained_on, now):
        return None, {}, (f"data.path={cfg.data.path!r} ({folder.resolve()}) holds other training tokens than the "
                          f"checkpoint was trained on (its train split is {identity_text(now)}, the checkpoint's was "
                          f"{identity_text(trained_on)}), so its tokenizer and eos id need not be the run's (the "
                          "folder re-prepared, or a relative data.path taken from another directory)")
    tok = folder / info.get("tokenizer", "tokenizer.json")
    extra = {"eos_token_id": info["eos_id"]} if "eos_id" in info else {}
    if tok.is_file():
        return tok, extra, ""
    return None, extra, f"{meta} names the tokenizer {str(tok)!r}, which is {'a folder' if tok.is_dir() else 'missing'}"


def export_hf(
    source: str | Path | Transformer,
    out_dir: str | Path,
    *,
    dtype: str = "bf16",
    push_to_hub: str | None = None,
    private: bool = True,
    tokenizer_json: str | Path | None = None,
    extra_config: dict[str, Any] | None = None,
    max_shard_bytes: int | None = None,
    allow_benchmark_routing: bool = False,
    custom_code: bool = False,
) -> ExportSummary:
    """Export a Transformer, a checkpoint dir or a run dir to a Hugging Face folder; optionally upload it.

    dtype: bf16 | fp16 | fp32. custom_code: ship moe-train's own modeling code in the folder (loaded with
    transformers' trust_remote_code=True), which exports any model, also those no stock transformers class computes.
    tokenizer_json / extra_config default to the data folder's tokenizer and eos id,
    max_position_embeddings to the checkpoint's data.seq_len, and to the checkpoint's hf_extra.json (written
    by import_hf), which takes precedence.
    """
    extra: dict[str, Any] = {}
    tokenizer_json = tokenizer_json or None  # "" is not given, for every kind of source
    picked = ""  # where the export found a tokenizer itself: its refusals name that, not a tokenizer_json= not given
    with contextlib.ExitStack() as open_files:  # a checkpoint's files stay open until the export is written
        if isinstance(source, Transformer):
            model_dict: dict[str, Any] = dataclasses.asdict(source.cfg)
            tensors: TensorSource = source.state_dict()
        else:
            checkpoint = _resolve_checkpoint(Path(source))
            _check_export_out(checkpoint, Path(out_dir))  # before anything is read
            cfg, tensors = open_files.enter_context(open_checkpoint_source(checkpoint))  # resolved once: one warning
            model_dict = cfg.to_dict()["model"]
            choose_model_type(model_dict, allow_benchmark_routing, custom_code)  # refused before the tokenizer warning
            data_tok, data_extra, data_tok_problem = _data_tokenizer(cfg, checkpoint)
            # The context the run trained at, not a length it never saw (tokenizer_config's model_max_length too).
            extra = {"max_position_embeddings": cfg.data.seq_len, **data_extra}
            # an import-hf output carries the Hugging Face folder's own tokenizer beside its weights
            own_tok = checkpoint / TOKENIZER_FILE
            if tokenizer_json is None and own_tok.is_file():
                tokenizer_json, picked = own_tok, "the checkpoint's own tokenizer.json (written by import-hf)"
            elif tokenizer_json is None and data_tok is not None:
                tokenizer_json, picked = data_tok, f"the tokenizer of the run's data.path={cfg.data.path!r}"
            if tokenizer_json is None and data_tok_problem:
                warnings.warn(f"export of {str(source)!r}: {data_tok_problem}; the folder gets no tokenizer.json: "
                              "pass one (export-hf --tokenizer, or tokenizer_json=)", stacklevel=2)
            elif tokenizer_json is None:
                warnings.warn(
                    f"export of {str(source)!r}: no tokenizer found for data.path={cfg.data.path!r} "
                    f"(data.cache_dir={cfg.data.cache_dir!r}, relative paths taken from {os.getcwd()}); the folder "
                    "gets no tokenizer.json: run from the training directory or pass one (export-hf --tokenizer, or "
                    "tokenizer_json=)", stacklevel=2)
            extra_file = checkpoint / HF_EXTRA_FILE
            if extra_file.is_file():
                extra.update(read_json_object(extra_file))
        extra.update(extra_config or {})
        kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        with _naming_a_picked_tokenizer(tokenizer_json, picked):
            if tokenizer_json is not None and Path(tokenizer_json).is_file():  # moe_ckpt names one not a file
                load_tokenizer(str(tokenizer_json))  # a file that is no tokenizer.json: refused before any weight is out
            summary = export_hf_folder(model_dict, tensors, out_dir, dtype=dtype, tokenizer_json=tokenizer_json,
                                       extra_config=extra, allow_benchmark_routing=allow_benchmark_routing,
                                       custom_code=custom_code, **kwargs)
    if push_to_hub:
        push_folder(out_dir, push_to_hub, private=private)
    return summary


@contextlib.contextmanager
def _naming_a_picked_tokenizer(tokenizer_json: str | Path | None, picked: str) -> Iterator[None]:
    """A refusal of a tokenizer the export picked itself (`picked` says where from) names it so and says how to
    choose another: the checks name the argument (tokenizer_json='p', --tokenizer 'p') the caller did not give."""
    try:
        yield
    except (HFConversionError, DataError) as e:
        path = str(tokenizer_json)
        named = [f"tokenizer_json={path!r}", f"--tokenizer {path!r}"]
        text = str(e)
        if not picked or not any(n in text for n in named):
            raise
        for n in named:
            text = text.replace(n, f"{picked} ({path!r}, which the export picked itself)", 1)
        raise type(e)(f"{text}; pass tokenizer_json= (export-hf --tokenizer) to ship another") from None


def _check_export_out(checkpoint: Path, out: Path) -> None:
    """The export renames its finished folder over out_dir: never over the checkpoint it reads (a model.safetensors
    + config.json checkpoint holds only names an export writes, so the out_dir check alone would let it replace
    the fp32 checkpoint by the export), nor over a folder holding it."""
    if not out.exists() or not checkpoint.exists():
        return
    source, target = checkpoint.resolve(), out.resolve()
    if source == target or target in source.parents:
        what = ("is the checkpoint being exported" if source == target
                else f"holds the checkpoint being exported ({checkpoint})")
        raise HFConversionError(f"out_dir={str(out)!r} {what}: the export would replace it; choose another out_dir")


def push_folder(folder: str | Path, repo_id: str, *, private: bool = True) -> None:
    """Create (if needed) and upload to a Hub model repo; credentials come from huggingface_hub's usual login."""
    api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                      commit_message="Upload model exported by moe-train")


TOKENIZER_FILE = "tokenizer.json"
# what import_hf writes into out_dir (tokenizer.json when the Hugging Face folder has one)
IMPORT_FILES = ("model.safetensors", "config.json", HF_EXTRA_FILE, TOKENIZER_FILE)


def _check_import_out(folder: Path, out: Path) -> None:
    """import_hf writes a new folder or over an earlier import (which holds HF_EXTRA_FILE): never into the
    Hugging Face folder it reads, whose config.json and model.safetensors ours would replace, and never over
    files it did not write. Checked before any tensor is read."""
    if out.exists() and not out.is_dir():
        raise HFConversionError(f"out_dir={str(out)!r} is a file; expected a folder (new, or an earlier import-hf output)")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if folder.is_dir() and out.resolve() == folder.resolve():
        raise HFConversionError(f"out_dir={str(out)!r} is the Hugging Face folder being imported: its config.json and "
                                "model.safetensors would be replaced by ours; choose another out_dir")
    # ".tmp-": the per-file temporary names imports of moe-train <= 0.14.0 could leave; they go with the folder
    foreign = sorted(p.name for p in out.iterdir() if p.name not in IMPORT_FILES and ".tmp-" not in p.name)
    if foreign or not (out / HF_EXTRA_FILE).is_file():
        what = f"holds {foreign[:5]}, which import-hf does not write" if foreign else f"has no {HF_EXTRA_FILE}"
        raise HFConversionError(f"out_dir={str(out)!r} {what}: it is not an earlier import-hf output, and importing "
                                "would overwrite its config.json / model.safetensors; choose a new or empty folder")


def import_hf(
    folder: str | Path, out_dir: str | Path | None = None, *, base: Config | None = None
) -> tuple[Config, dict[str, torch.Tensor]]:
    """A Hugging Face folder -> (Config, fp32 state dict by our names), checked tensor by tensor.

    base: the Config whose data / train / parallel sections (and training-only model fields) are kept.
    out_dir: also write model.safetensors + config.json (+ hf_extra.json, and the folder's tokenizer.json if it has
    one), a checkpoint export_hf reads: its export carries the same tokenizer.
    """
    if out_dir is not None:
        _check_import_out(Path(folder), Path(out_dir))
    hf = open_hf_folder(folder)
    merged = (base or Config()).to_dict()
    router = {**merged["model"]["router"], **hf.model_config["router"]} if "router" in hf.model_config else None
    merged["model"].update({k: v for k, v in hf.model_config.items() if k != "router"})
    if router is not None:
        merged["model"]["router"] = router
    if base is None:  # the embedded corpus must fit the model: `train --config OUT/config.json` runs on it as is
        merged["data"]["default_vocab_size"] = DataConfig.default_vocab_size_for(merged["model"]["vocab_size"])
    cfg = config_from_dict(merged)
    state = dict(hf.tensors())
    for name, t in state.items():  # before anything is written: train.init_from refuses such a tensor anyway
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            raise HFConversionError(f"{folder}: tensor {name} (by moe-train's name) holds {bad} NaN / Inf values of "
                                    f"{t.numel()}: expected finite weights (the folder is damaged, or its model "
                                    "diverged)")
    if out_dir is not None:
        unique = {k: v for k, v in state.items() if not (k == "lm_head.weight" and cfg.model.tie_embeddings)}
        tokenizer = Path(folder) / TOKENIZER_FILE

        def write(out: Path) -> None:
            if tokenizer.is_file():  # an earlier import's tokenizer belongs to another model: not carried over
                shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
            save_file({k: v.contiguous() for k, v in unique.items()}, str(out / "model.safetensors"))
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            (out / HF_EXTRA_FILE).write_text(json.dumps(hf.extra_config, indent=2) + "\n")

        # The files are written into a new folder beside out_dir, which then replaces it whole: an interrupted
        # import leaves the earlier import as it was, never a new config.json beside its weights.
        write_folder_whole(out_dir, write, check=lambda final: _check_import_out(Path(folder), final), what="import")
    return cfg, state
