"""What each `moe-train` command does once cli.py has parsed its arguments: train, info, bench, prepare-data,
inspect, export-hf and import-hf, and the checks on the checkpoint folders they are given. cli.py dispatches to them
and turns their errors into exit statuses."""

from __future__ import annotations

import json
import os
import shlex
import warnings
from pathlib import Path

from moe_train.cli_names import EXPORT_NAMES, IMPORT_NAMES, PREPARE_NAMES, typed_as
from moe_train.config import ConfigError, DataConfig


PREPARE_VOCAB_SIZE = 4096  # prepare-data's defaults
PREPARE_MAX_BYTES = 4_000_000


def _cmd_train(cfg) -> None:
    from moe_train.trainer.loop import Trainer

    from moe_train.trainer.metrics import standard_json

    trainer = Trainer(cfg)
    summary = trainer.train()
    if trainer.is_main:  # under torchrun, one summary rather than one per rank; a skipped last step's loss is null
        print(standard_json(summary))


def _cmd_info(cfg) -> None:
    from moe_train.model import count_params, flops_per_token

    c = count_params(cfg.model)
    print(json.dumps({"preset": cfg.preset, "params_total": c.total, "params_active": c.active,
                      "params_embedding": c.embedding,
                      "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len), "config": cfg.to_dict()},
                     indent=2))


def _cmd_bench(cfg, args) -> None:
    from moe_train.bench import run_bench

    if args.out:  # found out before the run, not after it
        out = os.path.abspath(args.out)
        if os.path.isdir(out):
            raise ConfigError(f"bench --out={args.out}: is a folder; expected a file path to write the JSON to")
        if not os.path.isdir(os.path.dirname(out)):
            raise ConfigError(f"bench --out={args.out}: its folder {os.path.dirname(out)!r} does not exist")
    result = run_bench(cfg, args.steps, args.warmup)
    if result.pop("rank") != 0:  # under torchrun: one report (its numbers cover every rank), one writer of --out
        return
    from moe_train.trainer.metrics import standard_json

    text = standard_json(result, indent=2)  # a NaN final loss is null
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _cmd_prepare(args) -> None:
    from moe_train.data import prepare_data, stdlib_documents, text_file_documents

    # options that would be ignored are refused, so nobody believes they took effect
    if args.tokenizer is not None and args.vocab_size is not None:
        raise ConfigError(f"--vocab-size={args.vocab_size} with --tokenizer={args.tokenizer}: an existing tokenizer "
                          "keeps its own vocabulary; pass one of the two")
    if args.eos_token is not None and args.tokenizer is None:
        raise ConfigError(f"--eos-token={args.eos_token} without --tokenizer: the BPE trained here ends documents "
                          "with <|endoftext|>; pass --tokenizer too, or drop --eos-token")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise ConfigError(f"--max-bytes={args.max_bytes}: expected a positive number of bytes")
    if args.inputs and args.max_bytes is not None:
        raise ConfigError(f"--max-bytes={args.max_bytes} applies to the default corpus only, and inputs were given "
                          f"({len(args.inputs)}); drop one of the two")
    if args.inputs:
        docs, source = text_file_documents(args.inputs), ",".join(args.inputs)  # each file read when tokenized
    else:
        max_bytes = PREPARE_MAX_BYTES if args.max_bytes is None else args.max_bytes
        docs, source = stdlib_documents(max_bytes), "python-stdlib"
    passed = {"vocab_size": PREPARE_VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
              "tokenizer_path": args.tokenizer, "eos_token": args.eos_token,
              "eval_fraction": DataConfig.eval_fraction if args.eval_fraction is None else args.eval_fraction}
    with typed_as(PREPARE_NAMES, passed):
        out = prepare_data(docs, args.out, source=source, **passed)
    meta = json.loads((out / "meta.json").read_text())
    train, held_out = meta["splits"]["train"], meta["splits"]["eval"]
    docs = f"{train['num_docs']:,} document{'' if train['num_docs'] == 1 else 's'}"
    n_eval = held_out["num_tokens"]
    print(f"wrote {out}: {train['num_tokens']:,} train token{'' if train['num_tokens'] == 1 else 's'} ({docs}), "
          f"{n_eval:,} eval token{'' if n_eval == 1 else 's'} ({held_out['num_docs']:,}), vocab_size={meta['vocab_size']}")
    _warn_of_a_split_shorter_than_a_window(train["num_tokens"], held_out["num_tokens"], passed["eval_fraction"])
    # the model's vocabulary must hold every id the tokenizer emits, and the presets' is not the folder's
    print(f"train on it: moe-train train --data.path={shlex.quote(str(out))} --model.vocab_size={meta['vocab_size']}")


def _warn_of_a_split_shorter_than_a_window(train_tokens: int, eval_tokens: int,
                                          eval_fraction: float | None = None) -> None:
    """prepare-data and inspect print a command that trains with the default config: a split shorter than one of its
    windows stops that run at start-up (a small --eval-fraction on a small corpus holds out a single token).
    eval_fraction: the one the folder was prepared with, where known."""
    from moe_train.config_io import build_config

    window = build_config(None, None, {}).data.seq_len + 1
    was = f" (it was {eval_fraction!r})" if eval_fraction is not None else ""
    short = [(name, count, fix) for name, count, fix in (
        ("train", train_tokens, f"prepare it with more text or a smaller --eval-fraction{was}, "
                                "or train with a shorter --data.seq_len"),
        ("eval", eval_tokens, f"prepare it with a larger --eval-fraction{was} or more text, or "
                              "train with a shorter --data.seq_len or --train.eval_interval=0"),
    ) if count < window]  # each split named: a fix for one alone would stop the run on the other
    for name, count, fix in short:
        warnings.warn(f"the {name} split holds {count:,} token{'' if count == 1 else 's'}, fewer than one window of "
                      f"data.seq_len+1={window}: a run on it stops before its first step; {fix}", stacklevel=2)


def _holds_checkpoint(folder) -> bool:
    """A checkpoint, or a folder of them (a run's checkpoints/). A folder named step-N, committed or not, counts:
    moe_ckpt says what is wrong with it."""
    from moe_ckpt import find_latest, step_of

    return ((folder / "index.json").exists() or step_of(folder.name.removesuffix(".tmp")) is not None
            or find_latest(folder) is not None)


def _existing_saved_run(given: str, expected: str):
    """Path(given), for inspect and export-hf; one that does not exist, or a run that has not saved yet, is
    refused naming it (moe_ckpt would say it has no index.json, or that no reader recognises it)."""
    from moe_train.trainer.checkpoint import checkpoint_root

    path = Path(given)
    if not path.exists():
        raise FileNotFoundError(f"{given!r} does not exist: {expected}")
    root = checkpoint_root(path)
    is_run = root.is_dir() or (path / "metrics.jsonl").is_file()  # checkpoints/ comes with the first save
    if (is_run or path.name == "checkpoints") and not _holds_checkpoint(root if root.is_dir() else path):
        raise FileNotFoundError(f"{'run ' if is_run else ''}{given!r} has no checkpoints yet (a run saves every "
                                "train.save_interval steps and at its last step; never with train.save_interval=0)")
    return path


def _exported_checkpoint(given: str) -> str:
    """Which checkpoint export-hf reads from `given`: a run folder's (or its checkpoints/ folder's) latest, named, so an
    export says its step."""
    from moe_train.trainer.checkpoint import newest_checkpoint

    found = newest_checkpoint(given)
    return str(found) if found is not None else given


def _resume_hint(cfg) -> str:
    """After a stopped run: where running it again starts (the steps since the latest checkpoint are lost)."""
    from moe_ckpt import step_of
    from moe_train.trainer.checkpoint import checkpoint_root, latest

    t = cfg.train
    root, found = checkpoint_root(t.run_dir), latest(t.run_dir)
    every = f"saved every {t.save_interval} steps" if t.save_interval else "train.save_interval=0 saves none"
    if found is None:
        return f"no checkpoint in {root} ({every}): running the command again starts from step 0"
    again = "run the same command again" if t.resume else "run it again with --resume (not --no-resume)"
    return f"latest checkpoint: {found} ({every}); {again} to resume from step {step_of(found)}"


def _cmd_inspect(args) -> int:
    """Print what the folder holds; the exit status: 1 for a checkpoint that cannot be loaded (DAMAGED), else 0."""
    from moe_ckpt import format_checkpoint, reports_damage
    from moe_train.hf_bridge import hugging_face_model_type
    from moe_train.trainer.checkpoint import checkpoint_root, newest_checkpoint

    expected = ("expected a checkpoint folder (with index.json), a run's checkpoints/ folder, a run folder, a "
                "model.safetensors + config.json folder or a data folder (with meta.json)")
    path = _existing_saved_run(args.checkpoint, expected)
    if not path.is_dir():
        raise NotADirectoryError(f"{args.checkpoint!r} is a file: {expected}")
    if checkpoint_root(path).is_dir():  # a run folder
        path = checkpoint_root(path)
    if not _holds_checkpoint(path):
        model_type = hugging_face_model_type(path)
        if model_type is not None:  # what import-hf reads, not what it writes
            raise FileNotFoundError(f"{args.checkpoint!r} is a Hugging Face model folder (config.json model_type="
                                    f"{model_type!r}), not moe-train's: `moe-train import-hf {args.checkpoint} OUT` "
                                    "converts it, then inspect OUT")
        if _is_model_folder(path):  # an import-hf output, which export-hf reads too
            print(_format_model_folder(path))
            return 0
        if (path / "meta.json").is_file():  # a data folder prepare-data wrote
            print(_format_data_folder(path))
            return 0
        raise FileNotFoundError(f"{args.checkpoint!r} holds no checkpoint (no index.json, checkpoints/ or "
                                f"metrics.jsonl) and no data (no meta.json): {expected}")
    path = newest_checkpoint(path) or path  # a checkpoints/ folder: its newest complete step, warning of later ones
    text = format_checkpoint(path, notes=_train_data_line)
    print(text)
    return 1 if reports_damage(text) else 0  # it cannot be loaded: a script's check fails


def _is_model_folder(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def _format_model_folder(folder: Path) -> str:
    """inspect's summary of a model.safetensors + config.json folder (import-hf writes one): its network and tensors."""
    from moe_ckpt import CheckpointError
    from safetensors import SafetensorError, safe_open

    try:
        config = json.loads((folder / "config.json").read_text())
        model = config.get("model") if isinstance(config, dict) else None
        model = model if isinstance(model, dict) else {}  # {"model": null} too
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            tensors = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
    except (OSError, ValueError, SafetensorError) as e:  # json's and safetensors' errors name no file
        raise CheckpointError(f"{str(folder)!r}: its config.json or model.safetensors cannot be read ({e})") from None
    shown = ("num_layers", "d_model", "num_experts", "vocab_size", "sliding_window_pattern")
    network = ", ".join(f"{k}={model[k]}" for k in shown if model.get(k) not in (None, []))
    lines = [f"model folder {folder}: {len(tensors)} tensors, "
             f"{(folder / 'model.safetensors').stat().st_size / 1e9:.3f} GB (model.safetensors + config.json, as "
             "import-hf writes; export-hf and train.init_from read it)",
             f"network: {network or '(no model section in config.json)'}"]
    width = max((len(n) for n in tensors), default=0)
    lines += [f"  {name:<{width}}  {dtype:<9} {str(shape):<20}" for name, (dtype, shape) in tensors.items()]
    return "\n".join(lines)


def _format_data_folder(folder: Path) -> str:
    """inspect's summary of a data folder: where its tokens came from, its tokenizer and each split, opened as a run
    opens it (the files' sizes against meta.json, the recorded largest ids against its vocab_size)."""
    from moe_train.data.token_file import DIGEST, _is_count, _is_recorded_id, open_data

    meta, splits = open_data(folder, None)
    tokenizer = meta.get("tokenizer")
    shipped = isinstance(tokenizer, str) and (folder / tokenizer).is_file()
    lines = [f"data folder {folder} ({meta['format']}, as prepare-data writes; train --data.path reads it)",
             f"source: {meta.get('source', '(not recorded)')}",
             f"tokenizer: {tokenizer if shipped else '(none in the folder)'}, vocab_size={meta['vocab_size']}, "
             f"eos_id={meta['eos_id']}"]
    for name, split in splits.items():
        recorded, count = meta["splits"][name], split.tokens.size
        docs = recorded.get("num_docs")
        docs = docs if _is_count(docs) else split.doc_ends.size  # older folders
        top, digest = recorded.get("max_token_id"), recorded.get("digest")
        # as open_data takes it: a recorded value that is no token id was not used (the split was read instead)
        top = top if _is_recorded_id(top, count) else ("(not recorded)" if top is None else
                                                       f"(meta.json's {top!r} is not a token id)")
        lines.append(f"{name}: {count:,} token{'' if count == 1 else 's'}, {docs:,} "
                     f"document{'' if docs == 1 else 's'}, largest id {top}, digest "
                     f"{digest[:len(DIGEST) + 12] + '…' if digest else '(not recorded)'}")
    _warn_of_a_split_shorter_than_a_window(splits["train"].tokens.size, splits["eval"].tokens.size)
    lines.append(f"train on it: moe-train train --data.path={shlex.quote(str(folder))} "
                 f"--model.vocab_size={meta['vocab_size']}")
    return "\n".join(lines)


def _train_data_line(metadata: dict) -> list[str]:
    """The line inspect adds to format_checkpoint's summary: the training data the checkpoint recorded."""
    from moe_train.data.token_file import identity_text

    identity = metadata.get("train_data")
    return [f"train data: {identity_text(identity) if isinstance(identity, dict) else '(not recorded)'}"]


def _cmd_hf(args) -> None:
    from moe_train.hf_bridge import export_hf, import_hf

    if args.command == "export-hf":
        _existing_saved_run(args.checkpoint, "expected a run folder, a checkpoint folder or a folder with "
                            "model.safetensors and config.json")
        source = _exported_checkpoint(args.checkpoint)
        passed = {"out_dir": args.out, "dtype": args.dtype, "push_to_hub": args.push_to_hub,
                  "tokenizer_json": args.tokenizer, "max_shard_bytes": args.max_shard_bytes}
        with typed_as(EXPORT_NAMES, passed):
            summary = export_hf(args.checkpoint, **passed, allow_benchmark_routing=args.allow_benchmark_routing,
                                custom_code=args.custom_code)
        shards = f"{summary.shards} shard{'s' if summary.shards != 1 else ''}"
        print(f"wrote {args.out}: {summary.architecture} from {source}, {summary.num_tensors} tensors, "
              f"{summary.total_bytes / 2**20:.1f} MiB of {args.dtype} in {shards}"
              f"{f', pushed to {args.push_to_hub}' if args.push_to_hub else ''}")
        # AutoTokenizer reads config.json through AutoConfig first: without trust_remote_code, a custom-code folder
        # makes it ask "Do you wish to run the custom code? [y/N]" (and wait 15 s) before it falls back
        remote = ", trust_remote_code=True" if args.custom_code else ""
        shipped = (Path(args.out) / "tokenizer.json").is_file()
        tokenizer = (f", AutoTokenizer.from_pretrained({args.out!r}{remote})" if shipped
                     else " (no tokenizer.json in it: export-hf --tokenizer ships one)")
        print(f"load it: transformers.AutoModelForCausalLM.from_pretrained({args.out!r}{remote}){tokenizer}")
    else:
        with typed_as(IMPORT_NAMES, {"out_dir": args.out}):
            cfg, _ = import_hf(args.folder, out_dir=args.out)
        print(f"wrote {args.out} (preset-free config, {cfg.model.num_layers} layers, {cfg.model.num_experts} experts)")
