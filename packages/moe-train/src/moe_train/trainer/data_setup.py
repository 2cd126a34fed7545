"""Resolve the data folder a run trains on, preparing the embedded corpus on first use."""

from __future__ import annotations

import sys
from pathlib import Path

from moe_train.config import Config, ConfigError, DataConfig
from moe_train.data import prepare_data, stdlib_documents
from moe_train.data.prepare import MAX_BPE_VOCAB, MIN_BPE_VOCAB


def default_data_dir(cfg: DataConfig) -> Path:
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    # Every setting that changes the folder's contents is in its name, so a changed one prepares a new folder;
    # the default eval fraction leaves the name as it always was (folders already prepared stay in use).
    split = "" if cfg.eval_fraction == DataConfig.eval_fraction else f"-e{float(cfg.eval_fraction)!r}"
    return Path(cfg.cache_dir) / f"stdlib-{py}-v{cfg.default_vocab_size}-b{cfg.default_max_bytes}{split}"


def check_embedded_corpus_settings(cfg: Config) -> None:
    """The embedded corpus's BPE size, refused naming its field before the corpus is read and tokenized (the BPE
    trainer would name only `vocab_size`, which reads as model.vocab_size)."""
    d = cfg.data
    if d.path != "default":
        return
    if not MIN_BPE_VOCAB <= d.default_vocab_size <= MAX_BPE_VOCAB:
        raise ConfigError(f"data.default_vocab_size={d.default_vocab_size}: expected {MIN_BPE_VOCAB} <= it <= "
                          f"{MAX_BPE_VOCAB} (2**20) for the embedded corpus's byte-level BPE (256 byte tokens and "
                          "<|endoftext|> at least)")
    if d.default_vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.default_vocab_size={d.default_vocab_size}: expected <= model.vocab_size="
                          f"{cfg.model.vocab_size} (the embedded corpus's BPE emits ids the model must embed); "
                          f"set data.default_vocab_size={cfg.model.vocab_size} or raise model.vocab_size")


def resolve_data_dir(cfg: DataConfig, is_main: bool) -> Path:
    """The folder to read. For "default", rank 0 tokenizes the stdlib once (others wait at a barrier)."""
    if cfg.path != "default":
        return Path(cfg.path)
    folder = default_data_dir(cfg)
    if is_main and not (folder / "meta.json").is_file():
        docs = list(stdlib_documents(cfg.default_max_bytes))
        prepare_data(docs, folder, vocab_size=cfg.default_vocab_size, eval_fraction=cfg.eval_fraction,
                     source="python-stdlib")
    return folder
