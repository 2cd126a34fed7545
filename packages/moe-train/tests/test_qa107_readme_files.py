"""The READMEs (README.md and packages/*/README.md) against the code, as a newcomer who trusts them finds it (QA 107).

test_qa55_readme.py runs the ```python blocks; this checks the rest, in-process, without training:
  - paths: every repo path a README cites (tests/, bench/, bench/results/, tools/, src/ and module paths such as
    `model/rope.py`, bare `*.py` / `*.json` / `*.log` names) exists, relative to its package, the repo root, the
    package's src/<module>, its bench/, or (a `tests/...` a README names as another package's) a sibling package;
  - results: every cited bench/results JSON parses, and every number with a unit (K tokens/s, GiB, ms, TFLOP/s,
    TB/s, GB/s, ×) in a paragraph citing one, and every number in a table citing one (or under / above a paragraph
    that does), is in that file at the README's rounding, or is a ratio of two numbers quoted beside it; the
    numbers that come from elsewhere (peers, hardware, derived estimates) are listed in NOT_FROM_FILE with why;
  - CLI: every `moe-train ...` command (bash blocks, inline code, torchrun -m moe_train) parses with
    moe_train.cli._parser(), its overrides set real config fields with values they accept, and bench's overrides pass
    bench's own refusal; every `--flag` shown alone in the root / moe-train README is an option, shorthand or a
    config field;
  - config: every `model.x` / `train.y` / `data.z` / `parallel.w` named in the root, moe-train, moe-ckpt and
    moe-parallel READMEs is a field of moe_train.config's dataclasses (a value given with `=` is accepted); every
    `x=value` in moe-train's README whose x is no field is listed in NOT_A_FIELD; presets named exist; the
    defaults the READMEs state (DEFAULTS) equal the dataclasses' and the CLI's;
  - API: every `from moe_x import ...` in a README, and every `moe_x.Name` / `moe_x.mod.Name` named, exists
    (top-level names in `__all__`); every `__all__` name appears in its package's README;
  - versions: moe-train's and moe-parallel's `==` pins equal the pinned packages' versions, each CHANGELOG's
    newest entry is its package's version, and no README names a version of a package past its current one.
Each check has a test that feeds it a damaged copy of a README and sees it fail.

What it found (QA 107, at moe-train 0.19.14), fixed in the READMEs:
  - moe-kernels' H100 table (README lines 280-283 after the edits) quoted three back-to-back TFLOP/s one too
    high: (a) E=8 dense 561 (file 560.47), (a) E=128 ours 476 (475.49), (b) E=128 torch block 401 (400.46); the
    number check found 476, the other two match other numbers in those files, so
    test_moe_kernels_h100_table_is_its_files_rows pins the table cell by cell;
  - 23 `__all__` names no README mentioned: moe-kernels grouped_gemm, grouped_gemm_reference, DispatchResult,
    IdentityCodec; moe-parallel RankCoords, OptimizerStepResult, moe_layers, ExpertShard, apply_fsdp;
    moe-precision KNOWN_RECIPES, PLANNED_RECIPES; moe-ckpt OpenCheckpoint, Region, SaveStats, format_checkpoint;
    moe-train ConfigError, ModelConfig, RouterConfig, DataConfig, TrainConfig, ParallelConfig, get_preset, PRESETS.
Every path, result file, command, flag, field, preset, default, version, pin and CHANGELOG agreed. No README names a
test function (only test files). A number matches any number of its file at the README's rounding (notes' text
included), so the number check is loose: it catches a number no run gave, not one put in the wrong cell.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import readme_sources  # noqa: E402
from readme_sources import MODULE, PACKAGES, README_NAMES, ROOT, readme_dir, readme_text  # noqa: E402


# ---------------------------------------------------------------- paths

PREFIXED = re.compile(r"(?<![\w.~/-])((?:\.\./)*(?:tests|bench|tools|src|packages|model|trainer|results|moe_kernels|"
                      r"shared)/[\w.*{},/-]*[\w*}/])")
BARE = re.compile(r"(?<![\w./*{},-])([\w*{},-]+\.(?:py|json|sh|log|txt|csv))(?![\w/])")
# run artifacts and example names a README shows, not files of the repository
ARTIFACTS = {"config.json", "index.json", "metadata.json", "tokenizer.json", "meta.json", "hf_extra.json",
             "generation_config.json", "results.json", "OUT.json", "F.json", "configuration_moe_train.py",
             "modeling_moe_train.py"}


@functools.cache
def repo_basenames() -> frozenset[str]:
    names = set()
    for top in (ROOT / "packages", ROOT / "tools"):
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", ".pytest_cache")]
            names.update(filenames)
    return frozenset(names)


def _braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [q for alt in m.group(1).split(",") for q in _braces(pattern[: m.start()] + alt + pattern[m.end():])]


def _matches(path: Path) -> list[Path]:
    out = []
    for p in _braces(str(path)):
        out += [Path(x) for x in sorted(Path("/").glob(p.lstrip("/")))] if any(c in p for c in "*?[") else \
            ([Path(p)] if Path(p).exists() else [])
    return out


def resolve(name: str, cited: str) -> list[Path]:
    """The files a README's path names (a glob gives every match); [] when none exists."""
    here = readme_dir(name)
    bases = [here, ROOT]
    if name != "root":
        bases += [here / "src" / MODULE[name], here / "src", here / "bench"]
    for base in bases:
        found = _matches(base / cited.rstrip("/"))
        if found:
            return found
    if cited.startswith("tests/"):  # moe-ckpt's README names moe-train's tests/test_qa94.py, saying so
        for p in PACKAGES:
            found = _matches(ROOT / "packages" / p / cited)
            if found:
                return found
    return []


def cited_paths(text: str) -> list[tuple[int, str]]:
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in PREFIXED.finditer(line):
            out.append((lineno, m.group(1)))
        for m in BARE.finditer(line):
            if m.group(1) not in ARTIFACTS:
                out.append((lineno, m.group(1)))
    return out


def missing_paths(name: str, text: str) -> list[str]:
    missing = []
    for lineno, cited in cited_paths(text):
        if cited.startswith("../") and not (readme_dir(name) / cited).resolve().is_relative_to(ROOT):
            continue  # ../shared/: the project's notes beside the repository, absent from a clone (CI's)
        if "/" in cited:
            if not resolve(name, cited):
                missing.append(f"{name} README line {lineno}: {cited}")
        elif not any(fnmatch.fnmatch(n, p) for p in _braces(cited) for n in repo_basenames()):
            missing.append(f"{name} README line {lineno}: {cited}")
    return missing


@pytest.mark.parametrize("name", README_NAMES)
def test_every_cited_path_exists(name):
    assert len(cited_paths(readme_text(name))) >= 3, name
    assert not missing_paths(name, readme_text(name))


def test_a_path_that_does_not_exist_is_found():
    text = readme_text("moe-train").replace("tests/test_compile.py", "tests/test_compiled.py")
    assert missing_paths("moe-train", text) == [f"moe-train README line {_line('moe-train', 'tests/test_compile.py')}"
                                                f": tests/test_compiled.py"]
    assert missing_paths("moe-kernels", "see `bench/results/h200_nothing.json` and `explore_nothing.py`") == [
        "moe-kernels README line 1: bench/results/h200_nothing.json", "moe-kernels README line 1: explore_nothing.py"]


def _line(name: str, needle: str) -> int:
    return next(i for i, line in enumerate(readme_text(name).splitlines(), 1) if needle in line)


# ---------------------------------------------------------------- bench results and their numbers

CITE = re.compile(r"((?:\.\./moe-train/|packages/[\w-]+/)?(?:bench/)?results/[\w.*{},-]+\.json|"
                  r"(?<![\w/])(?:h100|h200|cpu)_[\w*{},.-]+\.json)")
WITH_UNIT = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(K\b| ?GiB\b| ?ms\b| TFLOP/s| TB/s| GB/s| µs|×)")
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(K\b)?")
SCALES = (1, 1e3, 1e-3, 1e9, 1e12, 2**30, 0.01)  # as is, K, s -> ms, GB, TFLOP, GiB, fraction -> %

# (README, number as written, text just before it) -> why it is not in the cited file
NOT_FROM_FILE = {
    ("moe-ckpt", "0.5", "page faults there cost ~"): "a first-touch estimate from the two async rows",
    ("moe-ckpt", "24", "the 2-core / "): "the machine's memory",
    ("moe-ckpt", "8", "4,000 tensors of "): "a tensor shape, 8×16",
    ("moe-ckpt", "16", "4,000 tensors of 8×"): "a tensor shape, 8×16",
    ("moe-ckpt", "2.3", "(index.json "): "the index's size, measured by hand",
    ("moe-kernels", "71.8", "GPU busy 71.3 of "): "from the chrome trace (--trace), not kept in the JSON",
    ("moe-kernels", "36", "the GEMMs ("): "from the same trace",
    ("moe-kernels", "1.9", "per call in the profile, "): "from the same trace",
    ("moe-kernels", "35.8", "in the GEMMs: 33.2 ms of a "): "the .txt profile's CUDA total / 3 calls",
    ("moe-kernels", "595", "call, ~"): "FLOPs over the .txt profile's GEMM times",
    ("moe-kernels", "2.6", "combine kernels take "): "the .txt profile's other kernels / 3 calls",
    ("moe-kernels", "50", "nvidia-smi sampling every "): "the sampling interval",
    ("moe-kernels", "32", "| grouped_mm | cooperative "): "a tile config in the header, 32×6",
    ("moe-kernels", "64", "| cooperative 32×6 | cooperative "): "a tile config in the header, 64×3",
    ("moe-parallel", "0.98", "peak 130.4 vs 105.5 GiB), e32 "): "ratio of the e32 files' tokens/s",
    ("moe-parallel", "1.00", "vs 105.5 GiB), e32 0.98×, e8 "): "ratio of the e8 files' tokens/s",
    ("moe-precision", "21", "the H100 rates mean ~"): "40 GB over the measured rates",
    ("moe-train", "129", "took 100–102 ms for `none` and 121–"): "h200_bench_activation_checkpointing_recheck.json"
                                                                " (the paragraph above)",
    ("moe-train", "129", "a `full` step now takes 121–"): "the same file",
    ("moe-train", "77.5", "against OLMo-core 3's compiled "): "a peer's number, from FACTS.md",
    ("moe-train", "37.3", "compiled 77.5K / "): "a peer's number, from FACTS.md",
    ("moe-train", "2.80", "moe-precision `cast_weight`: "): "moe-precision's h100_cast_bandwidth.json",
}


# Percentages beside a result file: in it (as a percentage or a fraction), or the change between two numbers quoted
# beside them, or registered here. (README, percentage as written, text just before it) ->
#   (a, b): two numbers of the cited file(s), the percentage being |a / b - 1| as written (the pair is checked);
#   a str: why it is not a measurement (a target, a config fact).
# Before QA 147 no percentage was checked (review helper 156 changed README.md's -33% to -39% unnoticed).
PCT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)%")
PCT_SOURCES: dict[tuple[str, str, str], tuple[float, float] | str] = {  # traced by review helper 158
    ("root", "33", "(on an H200, −"): (16.589200019836426, 24.857518196105957),  # peak_mem_gib, mlp / none
    ("root", "20", "then decays it over the last "): "a config fact: train.lr_decay_fraction's default",
    ("moe-kernels", "1.6", "compiled within −"): "means of two samples each in the file's timings[3] "
                                                   "(triton, fullgraph): compiled 12.207 ms against eager 12.405",
    ("moe-kernels", "2.3", "compiled within −1.6%/+"): "means of two samples each in timings[4] (torch): "
                                                       "compiled 11.405 ms against eager 11.146",
    ("moe-kernels", "5", "1.0× on (b), E=128 at most "): "the issue's target",
    ("moe-kernels", "4.9", "back to back (−6.0%; one call −"): (473.0878504875696, 497.38251427137885),  # (a) 128 / 8
    ("moe-kernels", "7", "(b) E=128 +8% and (a) E=128 +"): "against the previous run of the table: h200_moe_block.json "
                                                           "at commit d7cbe55, 478.6, overwritten by this run's 513.3",
    ("moe-kernels", "15", "−5% / −8% on (a), −"): (524.3746741808885, 614.338327994434),  # (b) E=128 / E=8
    ("moe-kernels", "85", "on (b). The same verdicts: the "): "the issue's target",
    ("moe-kernels", "5", "(b); E=128 against E=8 −"): (473.0878504875696, 497.38251427137885),
    ("moe-kernels", "9", "and 611 at E=128 (−"): (610.6154467500729, 673.8322990785005),  # chain_bmm (b) 128 / 8
    ("moe-kernels", "10", "grouped_mm 648 → 586, −"): (585.5520434965856, 647.7456187115608),
    ("moe-kernels", "5", "while grouped_mm drops "): (566.1660797724521, 595.1971322968461),  # chain_grouped_mm (a)
    ("moe-kernels", "11.5", "rows per expert) is "): (571, 512),  # padded_m_tiles / m_tiles_needed, (b) E=128
    ("moe-kernels", "6.3", "more M-tiles than rows need ("): (1089, 1024),  # the same, (a) E=128
    ("moe-kernels", "0.8", "`bench/results/h200_tail_split.json`; "): "padding arithmetic on (b) E=8's routed counts, "
                                                                       "as the README says: not stored",
    ("moe-kernels", "10", "per-GEMM numbers fall a further ~"): "an aggregate: routed against balanced grouped_mm over "
                                                                 "the six GEMMs (mean -9.6%, FLOP-weighted -10.6%)",
    ("moe-kernels", "5", "from the balanced case. So the "): "the issue's target",
    ("moe-train", "4", "So FlexAttention costs "): (69092.91535046998, 71713.19494730342),  # tokens_per_s flex / off
    ("moe-train", "11", "SDPA's masked kernel costs "): (63554.943269145755, 71713.19494730342),  # sdpa / off
}

# tables whose data a paragraph further up names for the whole section, by header row
TABLE_DATA = {"moe-train": {  # "Earlier numbers": the section's `bench/results/h200_bench_*.json` at commit bef7006
    "| preset | params | tokens/s | step | model TFLOP/s | MFU (989 peak) | peak memory | bf16 resident weights: "
    "tokens/s, peak |": ["bench/results/h200_bench_fine_grained_e*{,_bf16}.json"]}}


def _numbers_of(obj) -> list[float]:
    out: list[float] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack += o.values()
        elif isinstance(o, list):
            stack += o
        elif isinstance(o, (int, float)) and not isinstance(o, bool):
            out.append(float(o))
        elif isinstance(o, str):  # a file's notes record numbers too ("47.6K tokens/s, 172 ms a step")
            out += [float(m) for m in re.findall(r"\d+(?:\.\d+)?", o)]
    return out


@functools.cache
def _file_numbers(path: Path) -> tuple[float, ...]:
    return tuple(_numbers_of(json.loads(path.read_text())))


def _decimals(s: str) -> int:
    return len(s.split(".")[1]) if "." in s else 0


def _in(x: float, d: int, values) -> bool:
    tol = 0.5 * 10**-d + 1e-9
    return any(abs(v / sc - x) <= tol for v in values for sc in SCALES)


def _is_ratio(x: float, d: int, quoted: list[tuple[float, int]]) -> bool:
    """x = a / b for two numbers a, b quoted beside it (each at its own rounding)."""
    for a, da in quoted:
        for b, db in quoted:
            if a and b and a != b:
                slack = 0.5 * 10**-d + (x * (0.5 * 10**-da / a + 0.5 * 10**-db / b))
                if abs(a / b - x) <= slack + 1e-9:
                    return True
    return False


def _paragraphs(text: str) -> list[tuple[int, str]]:
    out, start, lines = [], 1, []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            if not lines:
                start = i
            lines.append(line)
        elif lines:
            out.append((start, "\n".join(lines)))
            lines = []
    if lines:
        out.append((start, "\n".join(lines)))
    return out


def result_files(name: str, cited: str) -> list[Path]:
    c = cited if "/" in cited else f"bench/results/{cited}"
    if c.startswith("results/"):
        c = "bench/" + c
    return [p for p in resolve(name, c) if p.suffix == ".json"]


def unparsable_results(name: str, text: str) -> list[str]:
    bad = []
    for lineno, para in _paragraphs(text):
        for cited in CITE.findall(para):
            files = result_files(name, cited)
            if not files:
                bad.append(f"{name} README line {lineno}: {cited} does not exist")
            for f in files:
                try:
                    json.loads(f.read_text())
                except ValueError as e:
                    bad.append(f"{name} README line {lineno}: {cited} does not parse: {e}")
    return bad


def numbers_not_in_results(name: str, text: str) -> list[str]:
    paras = _paragraphs(text)
    cites = [CITE.findall(p) for _, p in paras]
    out = []
    for i, (lineno, para) in enumerate(paras):
        is_table = para.lstrip().startswith("|")
        files = set(cites[i])
        header = para.lstrip().splitlines()[0] if is_table else ""
        if header in TABLE_DATA.get(name, {}):
            files |= set(TABLE_DATA[name][header])
        elif is_table:  # a table goes with the nearest paragraph above it in its section that names its data,
            for j in range(i - 1, -1, -1):  # and with the one just below it
                if paras[j][1].startswith("#"):
                    break
                if cites[j]:
                    files |= set(cites[j])
                    break
            files |= set(cites[i + 1] if i + 1 < len(paras) else [])
        if not files:
            continue
        values = [v for c in sorted(files) for f in result_files(name, c) for v in _file_numbers(f)]
        if is_table:
            rows = [(lineno + j, row) for j, row in enumerate(para.splitlines()) if row.startswith("|")][2:]
            checks = []
            for ln, row in rows:
                offset = row.index("|", 1)  # past the first cell (the row's label)
                found = [(m, ln, row) for m in NUMBER.finditer(row, offset)]
                checks.append(found)
        else:
            checks = [[(m, lineno + para.count("\n", 0, m.start()), para) for m in WITH_UNIT.finditer(para)]]
        for group in checks:
            quoted = [(float(m.group(1).replace(",", "")) * (1000 if m.group(2) == "K" else 1),
                       _decimals(m.group(1)) - (3 if m.group(2) == "K" else 0)) for m, _, _ in group]
            for m, ln, src in group:
                s = m.group(1)
                x, d = float(s.replace(",", "")), _decimals(s)
                if _in(x, d, values) or _is_ratio(x, d, quoted):
                    continue
                before = src[max(0, m.start() - 80): m.start()]
                if any(key[0] == name and key[1] == s and before.replace("\n", " ").endswith(key[2])
                       for key in NOT_FROM_FILE):
                    continue
                out.append(f"{name} README line {ln}: {s}{m.group(2) or ''} (after {before[-40:]!r}) is not in "
                           f"{sorted(files)}")
        if not is_table:
            out += _percentages_not_traced(name, lineno, para, values, sorted(files))
    return out


def _percentages_not_traced(name: str, lineno: int, para: str, values, files: list[str]) -> list[str]:
    quoted = [(float(m.group(1).replace(",", "")) * (1000 if m.group(2) == "K" else 1),
               _decimals(m.group(1)) - (3 if m.group(2) == "K" else 0)) for m in WITH_UNIT.finditer(para)]
    out = []
    for m in PCT.finditer(para):
        s = m.group(1)
        x, d = float(s), _decimals(s)
        if _in(x, d, values) or _is_change(x, d, quoted):
            continue
        before = para[max(0, m.start() - 80): m.start()].replace("\n", " ")
        source = next((v for key, v in PCT_SOURCES.items() if key[0] == name and key[1] == s
                       and before.endswith(key[2])), None)
        if isinstance(source, str):
            continue
        if source is not None:
            a, b = source
            if all(any(abs(v - t) <= 1e-9 * max(1.0, abs(t)) for v in values) for t in (a, b)) and \
                    abs(abs(a / b - 1) * 100 - x) <= 0.5 * 10**-d + 1e-9:
                continue
            out.append(f"{name} README line {lineno + para.count(chr(10), 0, m.start())}: {s}% is registered as "
                       f"|{a} / {b} - 1|, which is not in {files} or not that percentage")
            continue
        out.append(f"{name} README line {lineno + para.count(chr(10), 0, m.start())}: {s}% (after {before[-40:]!r}) "
                   f"is neither in {files} nor the change between two numbers quoted beside it")
    return out


def _is_change(x: float, d: int, quoted: list[tuple[float, int]]) -> bool:
    """x% = |a / b - 1| for two numbers a, b quoted beside it (each at its own rounding)."""
    for a, da in quoted:
        for b, db in quoted:
            if a and b and a != b:
                slack = 0.5 * 10**-d + 100 * (a / b) * (0.5 * 10**-da / a + 0.5 * 10**-db / b)
                if abs(abs(a / b - 1) * 100 - x) <= slack + 1e-9:
                    return True
    return False


@pytest.mark.parametrize("name", README_NAMES)
def test_every_cited_result_parses(name):
    assert not unparsable_results(name, readme_text(name))


@pytest.mark.parametrize("name", README_NAMES)
def test_numbers_beside_a_result_file_are_in_it(name):
    assert not numbers_not_in_results(name, readme_text(name))


def h100_table_errors(text: str) -> list[str]:
    """moe-kernels' H100 table, cell by cell against its row of h100_moe_block_{a,b}.json (the loose check above
    finds a number anywhere in the file; this table had three numbers rounded the wrong way that it let through)."""
    results = ROOT / "packages/moe-kernels/bench/results"
    rows = {(r["shape"], r["E"]): r for s in "ab" for r in json.loads((results / f"h100_moe_block_{s}.json")
                                                                        .read_text())["rows"]}
    errors = []
    for m in re.finditer(r"^\| ([ab]) \| (\d+) \| (\d+) / (\d+) \| (\d+) / (\d+) \| (\d+) / (\d+) \|", text, re.M):
        row = rows[(m.group(1), int(m.group(2)))]
        want = [round(row[k][t]) for k in ("ours", "torch_grouped_mm", "dense")
                for t in ("tflops", "tflops_back_to_back")]
        if [int(g) for g in m.groups()[2:]] != want:
            errors.append(f"({m.group(1)}) E={m.group(2)}: README {list(map(int, m.groups()[2:]))}, file {want}")
    return errors if len(re.findall(r"^\| [ab] \| \d+ \| \d+ / ", text, re.M)) == 4 else ["table not found"]


def test_moe_kernels_h100_table_is_its_files_rows():
    assert not h100_table_errors(readme_text("moe-kernels"))
    assert h100_table_errors(readme_text("moe-kernels").replace("| 559 / 560 |", "| 559 / 561 |"))


def test_every_number_listed_as_not_from_a_file_is_still_in_its_readme():
    flat = {n: readme_text(n).replace("\n", " ") for n in README_NAMES}
    assert not [key for key in NOT_FROM_FILE if key[2] + key[1] not in flat[key[0]]]
    assert not [key for key in PCT_SOURCES if key[2] + key[1] + "%" not in flat[key[0]]]


def test_a_percentage_that_its_file_does_not_give_is_found():
    """Review helper 156 changed README.md's activation-checkpointing -33% to -39% and the test passed."""
    text = readme_text("root")
    assert "−33% peak memory" in text
    found = numbers_not_in_results("root", text.replace("−33% peak memory", "−39% peak memory"))
    assert len(found) == 1 and ": 39% " in found[0], found


def test_a_number_that_is_not_in_its_file_is_found():
    text = readme_text("moe-train").replace("| `mlp` | 68.5K |", "| `mlp` | 68.9K |")
    assert [m.split(" (after")[0] for m in numbers_not_in_results("moe-train", text)] == [
        f"moe-train README line {_line('moe-train', '| `mlp` | 68.5K |')}: 68.9K"]
    text = readme_text("moe-precision").replace("**2.80 TB/s", "**2.90 TB/s")
    assert len(numbers_not_in_results("moe-precision", text)) == 1
    assert unparsable_results("moe-train", "see `bench/results/h200_missing.json`") == [
        "moe-train README line 1: bench/results/h200_missing.json does not exist"]


def test_a_result_file_that_does_not_parse_is_found(tmp_path, monkeypatch):
    bad = tmp_path / "packages" / "moe-train" / "bench" / "results" / "h200_x.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    (tmp_path / "packages" / "moe-train" / "README.md").write_text("x")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setattr(readme_sources, "ROOT", tmp_path)  # readme_dir reads it there
    assert "does not parse" in unparsable_results("moe-train", "`bench/results/h200_x.json`")[0]
