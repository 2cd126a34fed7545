"""The `moe-train` command line: train, info, bench, export-hf, import-hf, inspect, prepare-data. This module holds
the argument parser and the dispatch; what each command does is in cli_commands.py.

Config errors and data errors exit with status 2 and one line naming the field and what was expected; one from a
library call names the flag or argument the user typed, not the library's parameter (cli_names.py).
"""

from __future__ import annotations

import argparse
import errno
import gc
import os
import signal
import sys
import textwrap
import traceback
import warnings

from moe_ckpt import CheckpointError
from moe_train.cli_commands import (PREPARE_MAX_BYTES, PREPARE_VOCAB_SIZE, _cmd_bench, _cmd_hf, _cmd_info, _cmd_inspect,
                                    _cmd_prepare, _cmd_train, _resume_hint)
from moe_train.config import ConfigError, DataConfig
from moe_train.config_io import build_config, parse_overrides
from moe_train.presets import PRESETS
from moe_train.trainer.ctrl_c import CtrlCWatch, stop_description
from moe_train.trainer.errors import TrainingError



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


class _StoreTrueOnce(argparse._StoreTrueAction):
    """A flag given twice is refused as any other option is (`--custom-code --custom-code`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).setdefault("_options_given", {})
        if self.dest in given:
            parser.error(f"argument {'/'.join(self.option_strings)}: given twice; pass it once")
        given[self.dest] = True
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
        self.register("action", "store_true", _StoreTrueOnce)

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
# set by train's shorthands, or (steps) replaced by bench's own --steps; bench reads none of them
BENCH_UNREAD = ("train.steps", "train.run_dir", "train.resume", "train.save_interval", "train.init_from")
BENCH_HELP = """
Refused here, as bench would ignore them (it writes no run folder,
--steps sets its steps and the model starts from a random init):
""" + textwrap.fill(", ".join(f"--{key}" for key in BENCH_UNREAD) + " and the shorthands of the first four.",
                    width=70)


def _path(text: str) -> str:
    """A path argument; an empty one (`--config "$UNSET"`) would be taken as no file, or as the current folder.
    A leading `~` is the home folder, as in a config's path fields: the shell leaves `--out=~/x` as typed, and
    prepare-data wrote a folder named `~` here while the command it printed trained on ~/x."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return os.path.expanduser(text)


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
    # description=help: a command's own --help says what it does, as `moe-train --help` lists it
    help_ = ("export a checkpoint to a Hugging Face folder that stock transformers loads "
             "(--custom-code: with trust_remote_code=True)")
    s = sub.add_parser("export-hf", help=help_, description=help_)
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
    help_ = ("convert a Hugging Face folder to our config.json and our-named model.safetensors "
             "(export-hf reads it; train --train.init_from=OUT starts a run from its weights)")
    s = sub.add_parser("import-hf", help=help_, description=help_)
    s.add_argument("folder", type=_path, help="a Hugging Face model folder (config.json and safetensors)")
    s.add_argument("out", type=_path, help="the folder to write config.json, model.safetensors and hf_extra.json into")
    help_ = ("list a checkpoint's tensors, shapes and the layout that wrote it; or describe a model folder or a "
             "data folder")
    s = sub.add_parser("inspect", help=help_, description=help_)
    s.add_argument("checkpoint", type=_path, help="a checkpoint folder, a run's checkpoints/ folder, a run folder, "
                   "a model.safetensors + config.json folder (an import-hf output), or a data folder (a "
                   "prepare-data output)")
    help_ = "tokenize text files into a data folder"
    s = sub.add_parser("prepare-data", help=help_, description=help_ + " (each file one document, UTF-8 only)")
    s.add_argument("inputs", nargs="*", type=_path, help="text files or folders (a folder: its *.txt, *.md and *.py "
                   "files in any case, in subfolders too, none under a hidden name; default: the Python standard "
                   "library)")
    s.add_argument("--out", type=_path, required=True, help="the data folder to write (an existing one is replaced)")
    s.add_argument("--vocab-size", type=int, default=None, help=f"of the BPE trained here (default {PREPARE_VOCAB_SIZE})")
    s.add_argument("--tokenizer", type=_path, default=None, help="an existing tokenizer.json instead of training a BPE")
    s.add_argument("--eos-token", default=None, metavar="TOKEN",
                   help="with --tokenizer: the token that ends each document (default: the first of <|endoftext|>, "
                        "<|end_of_text|>, </s>, <eos> it has)")
    s.add_argument("--max-bytes", type=int, default=None,
                   help=f"how much of the default corpus to read, when no inputs are given (default {PREPARE_MAX_BYTES})")
    s.add_argument("--eval-fraction", type=float, default=None,
                   help="the share of the tokens held out for eval, in blocks spread evenly over the corpus "
                        f"(default {DataConfig.eval_fraction})")
    for command in sub.choices.values():  # `moe-train train --version` too, not an override named "version"
        command.add_argument("--version", action=_VersionAction, help="print the versions and exit")
    p.commands = tuple(sub.choices)
    return p


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


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Our own warnings (moe_train, moe_ckpt) as one line, like our errors; others as Python shows them."""
    if any(f"{os.sep}{pkg}{os.sep}" in filename for pkg in ("moe_train", "moe_ckpt")):
        print(f"moe-train: warning: {message}", file=sys.stderr if file is None else file)
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


_default_show_warning = warnings.showwarning
# errors of the file system, not of moe-train: one line naming the path, no traceback (review helper 171: export-hf,
# import-hf and prepare-data into a read-only folder, and prepare-data or a checkpoint save on a full disk, printed one)
_FILE_SYSTEM_REFUSALS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"expected a command: one of {', '.join(parser.commands)}")
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return _run_and_collect(args, rest)
        except KeyboardInterrupt as e:  # a second Ctrl-C or SIGTERM while the first one's stop was being reported or
            # the process groups collected (review helper 174: two Ctrl-C 0.1 s apart printed a traceback)
            print(f"moe-train: stopped by {stop_description(e)}, again while stopping", file=sys.stderr)
            return 128 + getattr(e, "signum", signal.SIGINT)


def _run_and_collect(args, rest) -> int:
    """_run, with the file system's refusals as one line, and the collection of process groups after train and
    bench."""
    try:
        return _run(args, rest)
    except BrokenPipeError:  # `moe-train inspect RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing to flush into it at exit
        return 0
    except PermissionError as e:  # a path the user gave that this user may not read or write: one line naming it
        print(f"moe-train: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system refused: a read-only mount, a full disk or quota, a failing device
        if e.errno not in _FILE_SYSTEM_REFUSALS:
            raise
        print(f"moe-train: error: {args.command} stopped: {e}", file=sys.stderr)
        return 1
    finally:
        # A process group left in a reference cycle (an error's traceback holds the frames that hold it) is
        # freed here, while the interpreter is whole: a gloo group alive at exit can abort the process from
        # one of its worker threads (pytorch#190489), after the command has already given its answer. Only
        # train and bench make process groups; a full collection costs the other commands up to a second in
        # a long-lived process with a large heap.
        if args.command in ("train", "bench"):
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


def _build_config_warning_once(args, overrides: dict[str, str]):
    """build_config; its warnings (fields without effect, ignored corpus fields) shown by rank 0 alone: every
    process of a torchrun job builds the same config, and each printed them, once per rank. A process alone (no
    WORLD_SIZE > 1) shows them whatever RANK says, and a RANK or WORLD_SIZE that is no integer shows them too: a
    single-process run does not read RANK, and make_runtime refuses such a value where a run reads it."""
    from moe_train.trainer.launch import launched_rank, launched_world_size

    try:
        shown = args.command == "info" or launched_world_size() <= 1 or launched_rank() == 0  # info: no torchrun
    except ConfigError:
        shown = True
    with warnings.catch_warnings():
        if not shown:
            warnings.simplefilter("ignore")
        return build_config(args.preset, args.config, overrides)


def _run(args, rest) -> int:
    cfg = None
    try:
        if args.command == "inspect":
            _refuse_unknown(args.command, rest)
            return _cmd_inspect(args)
        if args.command in ("export-hf", "import-hf"):
            _refuse_unknown(args.command, rest)
            from moe_ckpt.hf import FolderWriteError

            try:
                with CtrlCWatch():  # SIGTERM as Ctrl-C: the half-written folder is removed (it died on the spot)
                    _cmd_hf(args)
            except FolderWriteError as e:  # a full disk, a file-size limit: one line naming the folder
                print(f"moe-train: error: {e}", file=sys.stderr)
                return 1
            return 0
        if args.command == "prepare-data":
            _refuse_unknown(args.command, rest)
            with CtrlCWatch():  # SIGTERM as Ctrl-C: prepare-data's .tmp folder was left behind, with no line said
                _cmd_prepare(args)
            return 0
        overrides = parse_overrides(expand_aliases(rest))
        if args.command == "bench":
            _refuse_unread_by_bench(overrides)
        cfg = _build_config_warning_once(args, overrides)
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
