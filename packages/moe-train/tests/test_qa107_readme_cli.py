"""QA 107, second half: the READMEs' moe-train commands, flags, config fields, presets, defaults and messages, public
API names, versions, pins and CHANGELOGs against the code (the module docstring of test_qa107_readme_files.py says what
QA 107 checks and found)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from readme_sources import MODULE, PACKAGES, README_NAMES, ROOT, readme_text  # noqa: E402


# ---------------------------------------------------------------- the command line

PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*|\d+\.\.\d+|.*\|.*")


def _inline_spans(text: str) -> list[tuple[int, str]]:
    """(line, text) of every `code span` outside fenced blocks; a span may run over a line break."""
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " "))
            for m in re.finditer(r"`([^`]+)`", prose)]


def _commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, argv after `moe-train`) for every moe-train command in bash blocks, indented blocks and inline code."""
    out = []
    lines = text.splitlines()
    i = 0
    fence = None
    while i < len(lines):
        line, start = lines[i], i + 1
        if line.startswith("```"):
            fence = line.strip() if fence is None else None
            i += 1
            continue
        if fence == "```bash" or (fence is None and line.startswith("    ")):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            out += [(start, cmd) for cmd in _argvs(line.split(" #")[0])]
        i += 1
    return sorted(out + [(ln, cmd) for ln, span in _inline_spans(text) for cmd in _argvs(span)])


def _argvs(s: str) -> list[list[str]]:
    try:
        words = shlex.split(s)
    except ValueError:
        return []
    for j, w in enumerate(words):
        if (w == "moe-train" or (w == "moe_train" and j and words[j - 1] == "-m")) and j + 1 < len(words):
            argv = words[j + 1:]
            if argv[0] in ("train", "info", "bench", "inspect", "export-hf", "import-hf", "prepare-data", "--version"):
                # `--dtype bf16|fp16|fp32`: one command per choice
                alts = [w for w in argv if "|" in w]
                if alts:
                    return [[x if x != alts[0] else choice for x in argv] for choice in alts[0].split("|")]
                return [[("4" if re.fullmatch(r"\d+\.\.\d+", w) else w) for w in argv]]
    return []


@functools.cache
def _parser():
    """moe_train.cli's parser, built once (each parse leaves it as it was)."""
    from moe_train import cli

    return cli._parser()


def cli_errors(text: str) -> list[str]:
    from moe_train.cli import _refuse_unread_by_bench, expand_aliases
    from moe_train.config_fields import field_annotation
    from moe_train.config_io import parse_overrides, read_override, set_field
    from moe_train.presets import get_preset

    errors = []
    for lineno, argv in _commands(text):
        where = f"line {lineno}: moe-train {' '.join(argv)}"
        if argv == ["--version"]:  # parsing it prints the versions and exits
            continue
        try:
            args, rest = _parser().parse_known_args(argv)
        except SystemExit:
            errors.append(f"{where}: refused by the parser")
            continue
        try:
            if args.command in ("train", "info", "bench"):
                overrides = parse_overrides(expand_aliases(rest))
                if args.command == "bench":
                    _refuse_unread_by_bench(overrides)
                preset = args.preset if args.preset and not PLACEHOLDER.fullmatch(args.preset) else "tiny"
                cfg = get_preset(preset)
                for key, value in overrides.items():
                    if PLACEHOLDER.fullmatch(value):
                        if field_annotation(key) is None:
                            raise ValueError(f"unknown config key {key!r}")
                    else:
                        set_field(cfg, key, read_override(key, value))
            elif rest:
                raise ValueError(f"unknown arguments {rest}")
        except ValueError as e:
            errors.append(f"{where}: {e}")
    return errors


# flags of other scripts a README shows, and an option shown as refused
NOT_MOE_TRAIN_FLAGS = {"--nproc-per-node", "--repeated-long-words", "--pre", "--dist"}  # other programs' flags


def flag_errors(text: str) -> list[str]:
    from moe_train.cli import ALIASES, SHORT_KEYS
    from moe_train.config_fields import field_annotation

    parser = _parser()
    options = {o for a in parser._actions for o in a.option_strings}
    for sub in parser._subparsers._group_actions[0].choices.values():
        options |= {o for a in sub._actions for o in a.option_strings}
    errors = []
    for lineno, span in _inline_spans(text):
        for flag in re.findall(r"(?<![\w-])(--[\w.-]+)", span):
            if flag in NOT_MOE_TRAIN_FLAGS or flag in options or flag in ALIASES or flag in SHORT_KEYS:
                continue
            if "." in flag and field_annotation(flag[2:]) is not None:
                continue
            errors.append(f"line {lineno}: {flag}")
    return errors


@pytest.mark.parametrize("name", ["root", "moe-train", "moe-ckpt", "moe-parallel"])
def test_every_moe_train_command_parses(name):
    commands = _commands(readme_text(name))
    assert name not in ("root", "moe-train") or len(commands) >= 10
    assert not cli_errors(readme_text(name))


@pytest.mark.parametrize("name", ["root", "moe-train"])
def test_every_flag_shown_is_an_option_or_a_field(name):
    assert not flag_errors(readme_text(name))


def test_a_command_the_parser_refuses_is_found():
    assert cli_errors("`moe-train export-hf runs/a out --dtyp fp16`")[0].startswith("line 1")
    assert "unknown config key" in cli_errors("```bash\nuv run moe-train train --model.num_expert=4\n```")[0]
    assert cli_errors("    torchrun -m moe_train info --preset olmo3-bench-e7")  # no such preset
    assert cli_errors("`moe-train bench --train.steps=3`")  # bench refuses it
    assert cli_errors("`moe-train train --train.compile=maybe`")  # a value the field refuses
    assert cli_errors("`moe-train prepare-data x --out d --vocab 5`")
    assert not cli_errors("`moe-train export-hf a b --dtype bf16|fp16|fp32` `moe-train bench --steps 4..10`")
    assert flag_errors("`--train.nothing=1` `--max-shard-byte`") == ["line 1: --train.nothing=1"[:-2],
                                                                      "line 1: --max-shard-byte"]


# ---------------------------------------------------------------- config fields, presets, defaults

FIELD = re.compile(r"(?<![\w./])(model|data|train|parallel)\.([a-z_]\w*(?:\.[a-z_]\w*)*)(?:=([^\s`),;:]+))?")
NOT_FIELDS = re.compile(r"(model\.(layers|safetensors|embed_tokens|norm|lm_head|zero_grad|named_parameters|"
                        r"state_dict|load_state_dict|to|half|double)\b|train\.u32|data\.json)")
# values the README shows as refused
REFUSED_VALUES = {"model.dense_layers=0"}
# `x=value` in moe-train's README whose x is not a config field
NOT_A_FIELD = {"strategy", "c", "dp", "ep", "T", "E", "k"}


def _field_names() -> set[str]:
    from moe_train.config import Config

    names, stack = set(), [Config()]
    while stack:
        obj = stack.pop()
        for f in dataclasses.fields(obj):
            names.add(f.name)
            if dataclasses.is_dataclass(getattr(obj, f.name)):
                stack.append(getattr(obj, f.name))
    return names


def field_errors(text: str) -> list[str]:
    from moe_train.config_fields import field_annotation
    from moe_train.config_io import read_override, set_field
    from moe_train.presets import get_preset

    errors = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in FIELD.finditer(line):
            if NOT_FIELDS.match(m.group(0)) or line[m.end(2): m.end(2) + 1] == "(":
                continue
            key = f"{m.group(1)}.{m.group(2)}"
            if field_annotation(key) is None:
                errors.append(f"line {lineno}: {key}")
            elif m.group(3) and not PLACEHOLDER.fullmatch(m.group(3)) and m.group(3)[0] not in "{[" and \
                    m.group(0) not in REFUSED_VALUES:
                value = m.group(3).strip("'\"")
                try:
                    set_field(get_preset("tiny"), key, read_override(key, value))
                except ValueError as e:
                    errors.append(f"line {lineno}: {key}={value}: {e}")
    return errors


def bare_field_errors(text: str) -> list[str]:
    fields = _field_names()
    return [f"line {lineno}: {m.group(1)}" for lineno, line in enumerate(text.splitlines(), 1)
            for span in re.findall(r"`([^`]+)`", line)
            for m in re.finditer(r"(?<![\w.\[-])([a-z_][a-z_0-9]*)=", span)
            if m.group(1) not in fields and m.group(1) not in NOT_A_FIELD]


def preset_errors(text: str) -> list[str]:
    from moe_train.presets import PRESETS

    named = set(re.findall(r"(?<![\w-])((?:olmo3-bench|fine-grained)-e\d+)\b", text))
    for stem, alts in re.findall(r"(olmo3-bench|fine-grained)-e\{([\d,]+)\}", text):
        named |= {f"{stem}-e{a}" for a in alts.split(",")}
    named |= set(re.findall(r"--preset[ =]([\w-]+)", text)) - {"P"}
    return sorted(n for n in named if n not in PRESETS)


@pytest.mark.parametrize("name", ["root", "moe-train", "moe-ckpt", "moe-parallel"])
def test_every_config_field_named_exists(name):
    assert not field_errors(readme_text(name))


def test_every_field_set_with_a_value_in_prose_exists():
    assert not bare_field_errors(readme_text("moe-train"))


@pytest.mark.parametrize("name", README_NAMES)
def test_every_preset_named_exists(name):
    assert not preset_errors(readme_text(name))


def test_a_field_or_preset_that_does_not_exist_is_found():
    assert field_errors("`train.lr_decay` and `model.router.routing=random`") == ["line 1: train.lr_decay"]
    assert field_errors("`--model.router.top_k=x`")[0].startswith("line 1: model.router.top_k=x: ")
    assert not field_errors("`--model.dense_layers=0` is refused")  # shown as refused: REFUSED_VALUES
    assert field_errors("`--model.dense_layers=1`")
    assert bare_field_errors("`top_k=1` and `normalise_top_k=true`") == ["line 1: normalise_top_k"]
    assert preset_errors("`fine-grained-e{8,16}` and `--preset tinyest`") == ["fine-grained-e16", "tinyest"]


# (README, phrase that states it, dotted field or callable, the value) -- the phrase must still be in the README
DEFAULTS = [
    ("root", "the `tiny` preset (a 4-layer MoE, 8 experts, top-2)", "tiny:model.num_layers", 4),
    ("root", "the `tiny` preset (a 4-layer MoE, 8 experts, top-2)", "tiny:model.num_experts", 8),
    ("root", "the `tiny` preset (a 4-layer MoE, 8 experts, top-2)", "tiny:model.router.top_k", 2),
    ("root", "writes `runs/default/metrics.jsonl`", "train.run_dir", "runs/default"),
    ("root", "(every 100\nsteps and at the last)", "train.save_interval", 100),
    ("root", "`--resume` is the default", "train.resume", True),
    ("root", "300 steps of\n2,048 tokens, 7 evals", "tiny:train.steps", 300),
    ("root", "300 steps of\n2,048 tokens, 7 evals", "tiny:tokens_per_step", 2048),
    ("root", "300 steps of\n2,048 tokens, 7 evals", "tiny:evals", 7),
    ("moe-train", "300 steps of 2,048 tokens, 7 evals", "tiny:evals", 7),
    ("root", "the tiny preset's is 2,048", "tiny:model.vocab_size", 2048),
    ("root", "prepare-data's BPE is 4,096", "PREPARE_VOCAB_SIZE", 4096),
    ("root", "over the last 20% of the steps", "train.lr_decay_fraction", 0.2),
    ("moe-train", "0.2 by default", "train.lr_decay_fraction", 0.2),
    ("moe-train", "`cosine`\n(the default)", "train.lr_schedule", "cosine"),
    ("moe-train", "`normalize_top_k=true` (the default)", "model.router.normalize_top_k", True),
    ("moe-train", "the default 1.0 skips the multiply", "model.router.routed_scaling_factor", 1.0),
    ("moe-train", "off by default, adding no parameter", "model.shared_expert_gate", False),
    ("moe-train", "`parallel.collective_timeout_s` (default 1800)", "parallel.collective_timeout_s", 1800),
    ("moe-train", "| `none` (default) |", "train.activation_checkpointing", "none"),
    ("moe-train", "`--train.compile=true` (default false)", "train.compile", False),
    ("moe-train", "bf16 (default), fp16 or fp32", "export-hf --dtype", "bf16"),
    ("moe-train", "plain fp32 weights (LocalRuntime) by default", "parallel.param_dtype", "fp32"),
    ("moe-train", "`train.lr_schedule`, each shape reaching", "train.lr_schedule", "cosine"),
    ("moe-ckpt", "The export dtype is `bf16` (the default)", "export-hf --dtype", "bf16"),
]


def _default(what: str):
    from moe_train.cli_commands import PREPARE_VOCAB_SIZE
    from moe_train.config import Config
    from moe_train.presets import get_preset

    if what == "PREPARE_VOCAB_SIZE":
        return PREPARE_VOCAB_SIZE
    if what == "export-hf --dtype":
        return _parser().parse_args(["export-hf", "a", "b"]).dtype
    cfg = Config()
    if what.startswith("tiny:"):
        what, cfg = what[5:], get_preset("tiny")
        if what == "tokens_per_step":
            return cfg.data.seq_len * cfg.train.micro_batch_size * cfg.train.grad_accum
        if what == "evals":  # at step 0 and every eval_interval steps, the last included
            return 1 + cfg.train.steps // cfg.train.eval_interval
    obj = cfg
    for part in what.split("."):
        obj = getattr(obj, part)
    return obj


def default_errors(texts: dict[str, str]) -> list[str]:
    errors = []
    for name, phrase, what, value in DEFAULTS:
        if phrase not in texts[name]:
            errors.append(f"{name} README no longer says {phrase!r}: update DEFAULTS")
        elif _default(what) != value:
            errors.append(f"{name} README says {phrase!r}: {what} is {_default(what)!r}, not {value!r}")
    return errors


def test_documented_defaults_are_the_code_defaults():
    assert not default_errors({n: readme_text(n) for n in README_NAMES})


def test_a_wrong_default_is_found(monkeypatch):
    from moe_train import config

    texts = {n: readme_text(n) for n in README_NAMES}
    monkeypatch.setattr(config.TrainConfig, "__init__", _with_default(config.TrainConfig, "save_interval", 50))
    assert default_errors(texts) == ["root README says '(every 100\\nsteps and at the last)': train.save_interval "
                                     "is 50, not 100"]
    texts["moe-train"] = texts["moe-train"].replace("(default 1800)", "(default 600)")
    assert any("no longer says" in e for e in default_errors(texts))


def _with_default(cls, name, value):
    init = cls.__init__

    def __init__(self, *a, **k):
        k.setdefault(name, value)
        init(self, *a, **k)
    return __init__


def message_errors(text: str) -> list[str]:
    """The config section's examples: its quoted error line is the real one, `bench` refuses the fields it lists."""
    from moe_train.cli import BENCH_UNREAD
    from moe_train.config_io import build_config

    errors = []
    m = re.search(r"`moe-train: error: (model\.router\.top_k=(\d+)): ([^`]+)`", text)
    try:
        build_config("tiny", None, {"model.router.top_k": m.group(2)})
        errors.append(f"{m.group(1)} is accepted")
    except ValueError as e:
        if str(e) != f"{m.group(1)}: {m.group(3)}":
            errors.append(f"the README quotes {m.group(1)}: {m.group(3)!r}; the code says {str(e)!r}")
    m = re.search(r"`bench` refuses\s+(.*?)\(it starts from a random init\)", text, re.S)
    listed = tuple(re.findall(r"`--(train\.\w+)`", m.group(1)))
    if sorted(listed) != sorted(BENCH_UNREAD):
        errors.append(f"the README says bench refuses {listed}; it refuses {BENCH_UNREAD}")
    if build_config("tiny", None, {"model.head_dim": "~"}).model.head_dim is not None:
        errors.append("--model.head_dim=~ is not null")
    return errors


def test_documented_config_messages_are_the_code_messages():
    assert not message_errors(readme_text("moe-train"))


def test_a_wrong_documented_message_is_found():
    text = readme_text("moe-train")
    assert message_errors(text.replace("top_k <= model.num_experts=8`", "top_k <= num_experts`"))
    assert message_errors(text.replace("`--train.save_interval` (it", "(it"))


# ---------------------------------------------------------------- public API

def import_errors(name: str, text: str) -> list[str]:
    errors = []
    for m in re.finditer(r"from (moe_\w+(?:\.\w+)*) import (?:\(([^)]*)\)|([^\n]*))", text):
        lineno = text.count("\n", 0, m.start()) + 1
        mod = importlib.import_module(m.group(1))
        names = (m.group(2) or m.group(3)).split("#")[0].replace("\n", " ").split(",")
        for n in [x.strip() for x in names if x.strip()]:
            n = n.split()[0]
            public = getattr(mod, "__all__", None) if "." not in m.group(1) else None
            if not hasattr(mod, n) or (public is not None and n not in public):
                errors.append(f"line {lineno}: {n} from {m.group(1)}")
    for m in re.finditer(r"(?<![\w.])(moe_(?:kernels|parallel|precision|ckpt|train)(?:\.\w+)+)", text):
        dotted = m.group(1)
        if dotted == "moe_ckpt.format_version":  # a key of old metadata.json files, as the README says
            continue
        if not _resolves(dotted):
            errors.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {dotted}")
    return errors


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, part in enumerate(parts[i:]):
            if not hasattr(obj, part):
                return False
            if i == 1 and j == 0 and part not in getattr(obj, "__all__", [part]) and not \
                    importlib.util.find_spec(f"{parts[0]}.{part}"):
                return False  # moe_x.Name: a top-level name is public only through __all__
            obj = getattr(obj, part)
        return True
    return False


def unmentioned(pkg: str, text: str) -> list[str]:
    public = importlib.import_module(MODULE[pkg]).__all__
    return [n for n in public if not re.search(rf"(?<!\w){re.escape(n)}(?!\w)", text)]


@pytest.mark.parametrize("name", README_NAMES)
def test_every_imported_or_named_api_exists(name):
    assert not import_errors(name, readme_text(name))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_public_name_is_in_its_readme(pkg):
    assert not unmentioned(pkg, readme_text(pkg))


def test_a_missing_or_unexported_name_is_found():
    assert import_errors("moe-kernels", "from moe_kernels import (permute,\n    no_such_op)") == [
        "line 1: no_such_op from moe_kernels"]
    assert import_errors("moe-parallel", "`moe_parallel.no_such.Thing` and `moe_kernels.AllToAllDispatcher`") == [
        "line 1: moe_parallel.no_such.Thing"]
    text = readme_text("moe-precision").replace("PLANNED_RECIPES", "planned recipes")
    assert unmentioned("moe-precision", text) == ["PLANNED_RECIPES"]


# ---------------------------------------------------------------- versions and changelogs

def _pyproject(pkg: str) -> dict:
    return tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())


def version_errors(texts: dict[str, str], changelogs: dict[str, str]) -> list[str]:
    versions = {p: _pyproject(p)["project"]["version"] for p in PACKAGES}
    errors = []
    for pkg in PACKAGES:
        for dep in _pyproject(pkg)["project"]["dependencies"]:
            m = re.fullmatch(r"(moe-[\w-]+)==(\S+)", dep)
            if m and versions[m.group(1)] != m.group(2):
                errors.append(f"{pkg} pins {dep}; {m.group(1)} is {versions[m.group(1)]}")
        top = re.search(r"^## (\S+)", changelogs[pkg], re.M)
        if not top or top.group(1) != versions[pkg]:
            errors.append(f"{pkg} CHANGELOG's newest entry is {top and top.group(1)}, the package is {versions[pkg]}")
    key = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    for name, text in texts.items():
        mentions = [(m.group(1), m.group(2)) for m in re.finditer(r"(moe-(?:kernels|parallel|precision|ckpt|train))"
                                                                  r" (\d+\.\d+(?:\.\d+)?)\b", text)]
        if name != "root":  # a package's README: a bare version ("since 0.16.0", "at 0.9.5") is its own
            mentions += [(name, v) for v in re.findall(r"(?:since|at|with|before|Before|from|in) (\d+\.\d+\.\d+)\b",
                                                       text)]
        for pkg, v in mentions:
            if key(v) > key(versions[pkg]):
                errors.append(f"{name} README names {pkg} {v}; it is at {versions[pkg]}")
    return errors


def _changelogs() -> dict[str, str]:
    return {p: (ROOT / "packages" / p / "CHANGELOG.md").read_text() for p in PACKAGES}


def test_versions_pins_and_changelogs_agree():
    assert not version_errors({n: readme_text(n) for n in README_NAMES}, _changelogs())


def test_a_version_disagreement_is_found():
    texts = {n: readme_text(n) for n in README_NAMES}
    texts["root"] += "\nmoe-kernels 0.99.0 did it"
    changelogs = _changelogs()
    changelogs["moe-ckpt"] = changelogs["moe-ckpt"].replace("## ", "## 9.9.9\n\n## ", 1)
    errors = version_errors(texts, changelogs)
    assert len(errors) == 2 and "moe-kernels 0.99.0" in errors[1] and "9.9.9" in errors[0]
