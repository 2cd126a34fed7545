"""The `moe-train` command line: train, info, bench, export-hf, import-hf, inspect, prepare-data.

Config errors and data errors exit with status 2 and one line naming the field and what was expected.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import sys
import traceback
import warnings
from pathlib import Path

from moe_ckpt import CheckpointError
from moe_train.config import ConfigError
from moe_train.config_io import build_config, parse_overrides
from moe_train.presets import PRESETS
from moe_train.trainer.errors import TrainingError


PREPARE_VOCAB_SIZE = 4096  # prepare-data's defaults
PREPARE_MAX_BYTES = 4_000_000


class _StoreOnce(argparse._StoreAction):
    """An option given twice is refused, as a repeated override or a key twice in a YAML file is
    (argparse keeps the last value without a word)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).setdefault("_options_given", {})
        if self.dest in given:
            option = "/".join(self.option_strings)
            parser.error(f"argument {option}: given twice ({given[self.dest]}, then {values}); pass it once")
        given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one line, like ours (argparse prints its usage above them); no abbreviated
    options (`--pre` for `--preset`: a later option starting the same way would change what it means);
    an option given twice is an error."""

    commands: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # sub-parsers are made by add_parser, with this class
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


VERSIONED = ("moe-train", "moe-kernels", "moe-parallel", "moe-ckpt", "moe-precision", "torch", "triton")


def versions() -> dict[str, str]:
    """The installed version of our five packages, torch and triton, from package metadata; torch's as torch
    gives it, with the CUDA build the metadata leaves out (2.11.0+cu128; the CLI has loaded torch already).
    A package run from source without being installed (tools/gpu_env.sh) shows its module's __version__."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    import torch

    found = {}
    for name in VERSIONED:
        try:
            found[name] = torch.__version__ if name == "torch" else version(name)
        except PackageNotFoundError:
            try:
                module = importlib.import_module(name.replace("-", "_"))
            except ImportError:
                found[name] = "not installed"
            else:
                found[name] = f"{getattr(module, '__version__', 'unknown')} (from source, not installed)"
    return found


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(f"{name} {v}" for name, v in versions().items()))
        parser.exit(0)


OVERRIDES_HELP = """\
Any config field is set as --section.field=value, e.g.
  --model.num_experts=16 --train.steps=500 --model.router.top_k=4
(`moe-train info` prints them all)."""
SHORTHANDS_HELP = """
Shorthands: --resume, --no-resume, --run-dir DIR, --save-interval N,
  --steps N"""
BENCH_HELP = """
Refused here, as bench would ignore them (it writes no run folder;
--steps sets its steps): --train.steps, --train.run_dir, --train.resume,
--train.save_interval and their shorthands."""
# set by train's shorthands, or (steps) replaced by bench's own --steps; bench reads none of them
BENCH_UNREAD = ("train.steps", "train.run_dir", "train.resume", "train.save_interval", "train.init_from")


def _path(text: str) -> str:
    """A path argument; an empty one (`--config "$UNSET"`) would be taken as no file, or as the current folder."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def _repo(text: str) -> str:
    if not text:  # an empty repo would skip the upload without a word
        raise argparse.ArgumentTypeError("expected a Hub repo id (user/name), got an empty string")
    return text


SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _byte_size(text: str) -> int:
    """A size in bytes: an integer, optionally with a unit (5GB as transformers' max_shard_size, 2GiB, 500MB).
    KB / MB / GB ending in a lowercase b are refused: transformers reads 500mb as bits (62.5 MB)."""
    number = text.strip().rstrip("BbIiKkMmGg")
    given_unit = text.strip()[len(number):]
    unit = given_unit.upper()
    if not number.isdecimal() or not number.isascii() or unit not in SIZE_UNITS or int(number) * SIZE_UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size >= 1 byte, an integer with an optional unit "
                                         "(B, KB, MB, GB, KiB, MiB, GiB), e.g. 5GB")
    if unit in ("KB", "MB", "GB") and given_unit.endswith("b"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a unit ending in a lowercase b is read as bits by transformers' max_shard_size "
            f"({int(number) * SIZE_UNITS[unit] // 8} bytes) and as bytes by most people; write {number}{unit} for "
            f"{int(number) * SIZE_UNITS[unit]} bytes")
    return int(number) * SIZE_UNITS[unit]


def _parser() -> _Parser:
    p = _Parser(prog="moe-train", description="Train sparse MoE language models.")
    p.add_argument("--version", action=_VersionAction,
                   help="print the versions of the five moe-* packages, torch and triton, and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in (("train", "train a model (no arguments: the embedded default)"),
                        ("info", "parameter counts, FLOPs per token and the resolved config"),
                        ("bench", "N training steps on synthetic tokens, reported as JSON")):
        epilog = OVERRIDES_HELP + (BENCH_HELP if name == "bench" else SHORTHANDS_HELP)
        s = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        s.add_argument("--preset", default=None, help=f"named preset: {', '.join(PRESETS)} (default: tiny)")
        s.add_argument("--config", type=_path, default=None, help="YAML file of overrides")
        if name == "bench":
            s.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
            s.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default 2)")
            s.add_argument("--out", type=_path, default=None, help="also write the JSON here")
    s = sub.add_parser("export-hf", help="export a checkpoint to a Hugging Face folder that stock transformers loads "
                                         "(--custom-code: with trust_remote_code=True)")
    s.add_argument("checkpoint", type=_path,
                   help="a run folder or its checkpoints/ folder (the latest checkpoint), or a checkpoint folder")
    s.add_argument("out", type=_path, help="the Hugging Face folder to write (new, or an earlier export)")
    s.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="of the exported weights (default bf16)")
    s.add_argument("--max-shard-bytes", type=_byte_size, default=None, metavar="SIZE",
                   help="largest safetensors shard in bytes, e.g. 5GB or 2GiB (default 4GiB; 5gb is refused: "
                        "transformers reads a lowercase b as bits)")
    s.add_argument("--push-to-hub", type=_repo, default=None, metavar="REPO",
                   help="also upload the folder to this Hub repo")
    s.add_argument("--allow-benchmark-routing", action="store_true",
                   help="export a random/uniform-routed model's router as a learned one")
    s.add_argument("--tokenizer", type=_path, default=None, metavar="TOKENIZER_JSON",
                   help="the tokenizer.json to ship (default: the run's data folder's, or an import's own)")
    s.add_argument("--custom-code", action="store_true",
                   help="ship moe-train's own modeling code in the folder (any model exports, also those no stock "
                        "transformers class computes); load it with trust_remote_code=True")
    s = sub.add_parser("import-hf", help="convert a Hugging Face folder to our config.json and our-named model.safetensors "
                           "(export-hf reads it; train --train.init_from=OUT starts a run from its weights)")
    s.add_argument("folder", type=_path, help="a Hugging Face model folder (config.json and safetensors)")
    s.add_argument("out", type=_path, help="the folder to write config.json, model.safetensors and hf_extra.json into")
    s = sub.add_parser("inspect", help="list a checkpoint's tensors, shapes and the layout that wrote it")
    s.add_argument("checkpoint", type=_path, help="a checkpoint folder, a run's checkpoints/ folder or a run folder")
    s = sub.add_parser("prepare-data", help="tokenize text files into a data folder")
    s.add_argument("inputs", nargs="*", type=_path, help="text files or folders (default: the Python standard library)")
    s.add_argument("--out", type=_path, required=True, help="the data folder to write (an existing one is replaced)")
    s.add_argument("--vocab-size", type=int, default=None, help=f"of the BPE trained here (default {PREPARE_VOCAB_SIZE})")
    s.add_argument("--tokenizer", type=_path, default=None, help="an existing tokenizer.json instead of training a BPE")
    s.add_argument("--eos-token", default=None, metavar="TOKEN",
                   help="with --tokenizer: the token that ends each document (default: the first of <|endoftext|>, "
                        "<|end_of_text|>, </s>, <eos> it has)")
    s.add_argument("--max-bytes", type=int, default=None,
                   help=f"how much of the default corpus to read, when no inputs are given (default {PREPARE_MAX_BYTES})")
    for command in sub.choices.values():  # `moe-train train --version` too, not an override named "version"
        command.add_argument("--version", action=_VersionAction, help="print the versions and exit")
    p.commands = tuple(sub.choices)
    return p


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
    vocab_size = PREPARE_VOCAB_SIZE if args.vocab_size is None else args.vocab_size
    out = prepare_data(docs, args.out, vocab_size=vocab_size, tokenizer_path=args.tokenizer, source=source,
                       eos_token=args.eos_token)
    meta = json.loads((out / "meta.json").read_text())
    train, held_out = meta["splits"]["train"], meta["splits"]["eval"]
    print(f"wrote {out}: {train['num_tokens']:,} train tokens ({train['num_docs']:,} documents), "
          f"{held_out['num_tokens']:,} eval tokens ({held_out['num_docs']:,}), vocab_size={meta['vocab_size']}")
    # the model's vocabulary must hold every id the tokenizer emits, and the presets' is not the folder's
    print(f"train on it: moe-train train --data.path={shlex.quote(str(out))} --model.vocab_size={meta['vocab_size']}")


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


def _cmd_inspect(args) -> None:
    from moe_ckpt import format_checkpoint
    from moe_train.trainer.checkpoint import checkpoint_root

    expected = "expected a checkpoint folder (with index.json), a run's checkpoints/ folder or a run folder"
    path = _existing_saved_run(args.checkpoint, expected)
    if not path.is_dir():
        raise NotADirectoryError(f"{args.checkpoint!r} is a file: {expected}")
    if checkpoint_root(path).is_dir():  # a run folder
        path = checkpoint_root(path)
    if not _holds_checkpoint(path):
        raise FileNotFoundError(f"{args.checkpoint!r} holds no checkpoint (no index.json, checkpoints/ or "
                                f"metrics.jsonl): {expected}")
    print(format_checkpoint(path))


ALIASES = {"--resume": "--train.resume=true", "--no-resume": "--train.resume=false"}
SHORT_KEYS = {"--save-interval": "--train.save_interval", "--steps": "--train.steps", "--run-dir": "--train.run_dir",
              "--resume": "--train.resume"}  # --resume=false as --train.resume=false


def expand_aliases(rest: list[str]) -> list[str]:
    """`--resume`, `--save-interval N` and friends as shorthands of dotted overrides."""
    out = []
    for arg in rest:
        key, eq, value = arg.partition("=")
        if arg in ALIASES:
            out.append(ALIASES[arg])
        elif key in SHORT_KEYS:
            out.append(SHORT_KEYS[key] + eq + value)
        else:
            out.append(arg)
    return out


def _cmd_hf(args) -> None:
    from moe_train.hf_bridge import export_hf, import_hf

    if args.command == "export-hf":
        _existing_saved_run(args.checkpoint, "expected a run folder, a checkpoint folder or a folder with "
                            "model.safetensors and config.json")
        source = _exported_checkpoint(args.checkpoint)
        summary = export_hf(args.checkpoint, args.out, dtype=args.dtype, push_to_hub=args.push_to_hub,
                            allow_benchmark_routing=args.allow_benchmark_routing, tokenizer_json=args.tokenizer,
                            max_shard_bytes=args.max_shard_bytes, custom_code=args.custom_code)
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
        cfg, _ = import_hf(args.folder, args.out)
        print(f"wrote {args.out} (preset-free config, {cfg.model.num_layers} layers, {cfg.model.num_experts} experts)")


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Our own warnings (moe_train, moe_ckpt) as one line, like our errors; others as Python shows them."""
    if any(f"{os.sep}{pkg}{os.sep}" in filename for pkg in ("moe_train", "moe_ckpt")):
        print(f"moe-train: warning: {message}", file=sys.stderr if file is None else file)
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


_default_show_warning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"expected a command: one of {', '.join(parser.commands)}")
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return _run(args, rest)
        except BrokenPipeError:  # `moe-train inspect RUN | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing to flush into it at exit
            return 0
        finally:
            # A process group left in a reference cycle (an error's traceback holds the frames that hold it) is
            # freed here, while the interpreter is whole: a gloo group alive at exit can abort the process from
            # one of its worker threads (pytorch#190489), after the command has already given its answer.
            gc.collect()


def _refuse_unknown(command: str, rest: list[str]) -> None:
    if rest:
        raise ConfigError(f"unknown arguments {rest}: {command} takes only the options `moe-train {command} --help` "
                          "lists (config overrides apply to train, info and bench)")


def _refuse_unread_by_bench(overrides: dict[str, str]) -> None:
    """A training run's own fields, set on bench's command line, are refused: bench would ignore them (a YAML
    file shared with train may hold them)."""
    for key in BENCH_UNREAD:
        if key in overrides:
            why = {"train.steps": "its measured steps are --steps N",
                   "train.init_from": "it times a randomly initialised model"}.get(key, "it writes no run folder")
            raise ConfigError(f"bench --{key}={overrides[key]}: bench does not read {key} ({why}); drop it")


def _run(args, rest) -> int:
    cfg = None
    try:
        if args.command == "inspect":
            _refuse_unknown(args.command, rest)
            _cmd_inspect(args)
            return 0
        if args.command in ("export-hf", "import-hf"):
            _refuse_unknown(args.command, rest)
            _cmd_hf(args)
            return 0
        if args.command == "prepare-data":
            _refuse_unknown(args.command, rest)
            _cmd_prepare(args)
            return 0
        overrides = parse_overrides(expand_aliases(rest))
        if args.command == "bench":
            _refuse_unread_by_bench(overrides)
        cfg = build_config(args.preset, args.config, overrides)
        if args.command == "train":
            _cmd_train(cfg)
        elif args.command == "info":
            _cmd_info(cfg)
        else:
            _cmd_bench(cfg, args)
    except (ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError, CheckpointError) as e:
        print(f"moe-train: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:  # the run started but could not go on (non-finite losses)
        print(f"moe-train: training stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (torchrun, a scheduler): one line per rank, no traceback
        from moe_train.trainer.ctrl_c import stop_description

        signum = getattr(e, "signum", signal.SIGINT)  # a Ctrl-C outside the training loop is a plain one
        where = getattr(e, "stopped_at", None)  # set by the trainer once the run has started
        # the progress bar is closed when the frames holding it go: before our line, not over it at exit
        traceback.clear_frames(e.__traceback__)
        print(f"moe-train: stopped by {stop_description(e)}{f', {where}' if where else ''}", file=sys.stderr)
        if where and args.command == "train" and getattr(e, "on_main_rank", True):  # one hint under torchrun
            print(_resume_hint(cfg), flush=True)
        return 128 + signum  # the shell's code for a process the signal ended
    except ValueError as e:
        from moe_ckpt.hf import HFConversionError
        from moe_train.data import DataError

        if isinstance(e, (DataError, HFConversionError)):
            print(f"moe-train: error: {e}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
