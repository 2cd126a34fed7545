"""Build each package's wheel and check what a user installing it gets, without installing anything.

Per package (packages/*/pyproject.toml), from the wheel `uv build --wheel` makes:
- name, version, Requires-Python, license expression and README body in METADATA equal pyproject's, and
  `__version__` in the package's __init__.py (where it has one) equals the version too;
- Requires-Dist equals pyproject's dependencies and optional-dependencies, and each exact pin on a sibling
  (`moe-kernels==X`) names that sibling's current version (or the wheels cannot be installed together);
- the wheel holds every file under src/<import name> (byte for byte: modules, py.typed, data such as
  moe-ckpt's hf/remote_code/*.py) and nothing else: no tests, no conftest, no bytecode;
- every path the code builds from `__file__` (`Path(__file__).parent / "remote_code"`) or reads with
  importlib.resources is in the wheel, and none points outside the package;
- every import of a third-party module (module level or inside a function: a code path users reach) is of a
  declared dependency; an import inside `try: ... except ImportError` (or under TYPE_CHECKING) is optional and
  listed, not required;
- each console script's `module:function` exists in the wheel.

With --sdist each sdist is built too, and a wheel built from it must hold the same files and METADATA.
Prints a JSON summary; exits 1 when any package has an error. Warnings (e.g. an extra no code imports)
do not fail the check.

usage: python tools/check_wheels.py [--packages moe-ckpt moe-train] [--out-dir DIR] [--sdist]
       python tools/check_wheels.py --wheel-dir DIR   # check wheels built already (no build)
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Import name -> distribution name, where they differ beyond "_" -> "-".
DISTRIBUTION_OF = {
    "yaml": "pyyaml",
    "huggingface_hub": "huggingface-hub",
}
# Errors an `except` must catch for the import inside its `try` to count as optional.
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"not a requirement: {req!r}")
    return canonical(m.group(1))


def normalized_requirement(req: str) -> str:
    """A requirement string compared whitespace- and quote-insensitively: `triton>=3.6; platform_system == "Linux"`
    and `triton>=3.6; platform_system == 'Linux'` are equal."""
    return re.sub(r"\s+", "", req.replace('"', "'"))


# --------------------------------------------------------------------------------------------- the build
def find_packages(root: Path, names: list[str] | None) -> list[Path]:
    found = {p.parent.name: p.parent for p in sorted((root / "packages").glob("*/pyproject.toml"))}
    if not names:
        return list(found.values())
    unknown = [n for n in names if n not in found]
    if unknown:
        raise SystemExit(f"unknown package(s) {', '.join(unknown)}; expected some of {', '.join(found)}")
    return [found[n] for n in names]


def uv_command() -> list[str]:
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("uv is not on PATH: `python3 -m pip install uv` (the wheels are built with `uv build`)")
    return [uv]


def build(pkg_dir: Path, out_dir: Path, kind: str = "wheel") -> Path:
    """`uv build --wheel|--sdist pkg_dir` into out_dir (a fresh folder per package); returns the file it made.
    pkg_dir may also be an sdist (.tar.gz): the wheel is then built from it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.iterdir())
    cmd = uv_command() + ["build", f"--{kind}", "--quiet", "--out-dir", str(out_dir), str(pkg_dir)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    suffix = ".whl" if kind == "wheel" else ".tar.gz"
    made = [p for p in set(out_dir.iterdir()) - before if p.name.endswith(suffix)]
    if len(made) != 1:  # an unchanged rebuild overwrites the same name
        made = sorted(out_dir.glob(f"*{suffix}"), key=lambda p: p.stat().st_mtime)[-1:]
    if not made:
        raise RuntimeError(f"{' '.join(cmd)} made no {suffix} in {out_dir}")
    return made[0]


# ------------------------------------------------------------------------------------------ the project
def read_project(pkg_dir: Path) -> dict[str, Any]:
    data = tomllib.loads((pkg_dir / "pyproject.toml").read_text())
    project = data["project"]
    wheel_packages = data.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {}).get(
        "packages")
    import_name = project["name"].replace("-", "_")
    src = pkg_dir / "src" / import_name
    if wheel_packages:
        src = pkg_dir / wheel_packages[0]
        import_name = src.name
    return {"project": project, "import_name": import_name, "src": src}


def source_files(src: Path) -> dict[str, bytes]:
    """Files under the package's source folder (what the wheel should hold), by their path in the wheel."""
    out = {}
    for p in sorted(src.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
            out[f"{src.name}/{p.relative_to(src).as_posix()}"] = p.read_bytes()
    return out


# ------------------------------------------------------------------------------------------- the imports
def _handler_catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in IMPORT_ERRORS for t in types)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, filename: str) -> list[dict[str, Any]]:
    """Every absolute import in a module: {"module": top-level name, "line", "where": module|function,
    "optional": inside try/except ImportError or under TYPE_CHECKING}. importlib.import_module("name") with a
    constant name counts as an import."""
    tree = ast.parse(source, filename)
    found: list[dict[str, Any]] = []

    def visit(node: ast.AST, in_function: bool, optional: bool) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        for n in names:
            found.append({"module": n.split(".")[0], "line": node.lineno,
                          "where": "function" if in_function else "module", "optional": optional})
        if isinstance(node, ast.Try) or (hasattr(ast, "TryStar") and isinstance(node, ast.TryStar)):
            guarded = any(_handler_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, in_function, optional or guarded)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, in_function, optional)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, optional)
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, optional)

    visit(tree, False, False)
    return found


def _is_file_anchor(node: ast.expr) -> bool:
    """`Path(__file__)`, `Path(__file__).resolve()` or `.absolute()`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("resolve", "absolute"):
        return _is_file_anchor(node.func.value)
    return (isinstance(node, ast.Call) and len(node.args) == 1 and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "__file__")


def _path_parts(node: ast.expr) -> tuple[int, list[str]] | None:
    """`Path(__file__).parent.parent / "a" / "b"` -> (2, ["a", "b"]); None when not built from __file__."""
    parts: list[str] = []
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        if not (isinstance(node.right, ast.Constant) and isinstance(node.right.value, str)):
            return None
        parts.insert(0, node.right.value)
        node = node.left
    ups = 0
    while isinstance(node, ast.Attribute) and node.attr == "parent":
        ups += 1
        node = node.value
    if ups == 0 or not parts or not _is_file_anchor(node):
        return None
    return ups, parts


def _os_path_parts(node: ast.expr) -> tuple[int, list[str]] | None:
    """`os.path.join(os.path.dirname(__file__), "a", "b")` -> (1, ["a", "b"])."""
    def attr_is(n: ast.expr, name: str) -> bool:
        return isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
    if not (attr_is(node, "join") and node.args and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                        for a in node.args[1:])):
        return None
    base, ups = node.args[0], 0
    while attr_is(base, "dirname") and base.args:
        ups += 1
        base = base.args[0]
    if ups == 0 or not (isinstance(base, ast.Name) and base.id == "__file__"):
        return None
    return ups, [a.value for a in node.args[1:]]


def runtime_paths(source: str, module_path: str) -> list[dict[str, Any]]:
    """Paths a module builds from `__file__` (`Path(__file__).parent / "remote_code"`) or opens with
    importlib.resources (`files("pkg") / "x"`), as paths inside the wheel: {"line", "path", "outside": the path
    leaves the top-level package}."""
    tree = ast.parse(source, module_path)
    out = []
    here = module_path.split("/")[:-1]  # the module's folder inside the wheel
    inner: set[int] = set()  # `a / "b"` inside `a / "b" / "c"`: only the whole path counts
    for node in ast.walk(tree):
        got = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and id(node) not in inner:
            got = _path_parts(node)
            left = node.left
            while isinstance(left, ast.BinOp):
                inner.add(id(left))
                left = left.left
        elif isinstance(node, ast.Call):
            got = _os_path_parts(node)
        if got is not None:
            ups, parts = got
            if ups - 1 >= len(here):  # above the top-level package: the checkout's files, not the wheel's
                out.append({"line": node.lineno, "path": "/".join(parts), "outside": True})
            else:
                out.append({"line": node.lineno, "path": "/".join([*here[: len(here) - (ups - 1)], *parts]),
                            "outside": False})
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.left, ast.Call)
                and isinstance(node.left.func, (ast.Attribute, ast.Name))
                and (node.left.func.attr if isinstance(node.left.func, ast.Attribute) else node.left.func.id) == "files"
                and node.left.args and isinstance(node.left.args[0], ast.Constant)
                and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str)):
            pkg = str(node.left.args[0].value).replace(".", "/")
            out.append({"line": node.lineno, "path": f"{pkg}/{node.right.value}", "outside": False})
    return out


def distribution_of(module: str) -> str:
    return canonical(DISTRIBUTION_OF.get(module, module))


# ---------------------------------------------------------------------------------------------- the check
def read_wheel(wheel: Path) -> tuple[dict[str, bytes], email.message.Message, str, str | None]:
    with zipfile.ZipFile(wheel) as z:
        files = {n: z.read(n) for n in z.namelist() if not n.endswith("/")}
    dist_info = [n for n in files if n.endswith(".dist-info/METADATA")]
    if len(dist_info) != 1:
        raise RuntimeError(f"{wheel.name}: expected one .dist-info/METADATA, found {dist_info}")
    prefix = dist_info[0][: -len("METADATA")]
    meta = email.parser.Parser().parsestr(files[dist_info[0]].decode())
    entry_points = files.get(prefix + "entry_points.txt")
    return files, meta, prefix, entry_points.decode() if entry_points else None


def _entry_points(text: str | None) -> dict[str, dict[str, str]]:
    groups: dict[str, dict[str, str]] = {}
    group = None
    for line in (text or "").splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            group = line[1:-1]
            groups[group] = {}
        elif "=" in line and group:
            k, v = line.split("=", 1)
            groups[group][k.strip()] = v.strip()
    return groups


def _defines(source: str, name: str) -> bool:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def sibling_versions(root: Path) -> dict[str, str]:
    out = {}
    for p in (root / "packages").glob("*/pyproject.toml"):
        project = tomllib.loads(p.read_text())["project"]
        out[canonical(project["name"])] = project["version"]
    return out


def check_wheel(pkg_dir: Path, wheel: Path, siblings: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything this tool checks of one package's wheel against its source folder: {"errors": [...],
    "warnings": [...], and what was found}. siblings: canonical name -> version of the workspace's packages
    (exact pins on them are checked against it)."""
    info = read_project(pkg_dir)
    project, import_name, src = info["project"], info["import_name"], info["src"]
    name, version = project["name"], project["version"]
    errors: list[str] = []
    warnings: list[str] = []
    files, meta, dist_info, entry_points_txt = read_wheel(wheel)
    pkg_files = {n: b for n, b in files.items() if not n.startswith(dist_info)}

    # metadata
    if canonical(meta["Name"] or "") != canonical(name):
        errors.append(f"METADATA Name {meta['Name']!r} != pyproject name {name!r}")
    if meta["Version"] != version:
        errors.append(f"METADATA Version {meta['Version']!r} != pyproject version {version!r}")
    if f"-{version}-" not in wheel.name:
        errors.append(f"wheel file name {wheel.name} does not carry version {version}")
    if project.get("requires-python") and meta["Requires-Python"] != project["requires-python"]:
        errors.append(f"METADATA Requires-Python {meta['Requires-Python']!r} != {project['requires-python']!r}")
    lic = project.get("license")
    if isinstance(lic, str) and meta["License-Expression"] != lic:
        errors.append(f"METADATA License-Expression {meta['License-Expression']!r} != pyproject license {lic!r}")
    if not meta.get_all("License-File"):
        errors.append("no license text in the wheel (no License-File; hatchling ships a LICENSE* file found in "
                      f"{pkg_dir.name}/, and there is none there: Apache-2.0 4(a) asks that recipients get a copy)")
    readme = project.get("readme")
    if isinstance(readme, str):
        body = meta.get_payload()
        if (pkg_dir / readme).read_text().strip() != (body or "").strip():
            errors.append(f"METADATA description is not {readme}")
        if readme.endswith(".md") and meta["Description-Content-Type"] != "text/markdown":
            errors.append(f"Description-Content-Type {meta['Description-Content-Type']!r}: expected text/markdown")
    init = src / "__init__.py"
    m = re.search(r'^__version__\s*=\s*["\']([^"\']+)', init.read_text(), re.MULTILINE) if init.is_file() else None
    if m and m.group(1) != version:
        errors.append(f"{import_name}.__version__ = {m.group(1)!r} != pyproject version {version!r}")

    # declared dependencies
    requires = meta.get_all("Requires-Dist") or []
    wheel_required = sorted(normalized_requirement(r) for r in requires if "extra ==" not in r.replace('"', "'"))
    declared = sorted(normalized_requirement(r) for r in project.get("dependencies", []))
    if wheel_required != declared:
        errors.append(f"Requires-Dist {wheel_required} != pyproject dependencies {declared}")
    wheel_extras = sorted(meta.get_all("Provides-Extra") or [])
    if wheel_extras != sorted(project.get("optional-dependencies", {})):
        errors.append(f"Provides-Extra {wheel_extras} != optional-dependencies {sorted(project.get('optional-dependencies', {}))}")
    declared_names = {requirement_name(r) for r in project.get("dependencies", [])}
    for r in project.get("dependencies", []):
        pin = re.match(r"\s*([A-Za-z0-9._-]+)\s*==\s*([^;\s]+)", r)
        if pin and siblings and canonical(pin.group(1)) in siblings and siblings[canonical(pin.group(1))] != pin.group(2):
            errors.append(f"pins {r!r} but {pin.group(1)} is at {siblings[canonical(pin.group(1))]}")

    # the files
    expected = source_files(src)
    missing = sorted(set(expected) - set(pkg_files))
    if missing:
        errors.append(f"files under {src.relative_to(pkg_dir)} missing from the wheel: {missing}")
    differ = sorted(n for n in set(expected) & set(pkg_files) if expected[n] != pkg_files[n])
    if differ:
        errors.append(f"files that differ from the source: {differ}")
    extra = sorted(set(pkg_files) - set(expected))
    if extra:
        errors.append(f"files in the wheel that are not under {src.relative_to(pkg_dir)}: {extra}")
    testish = sorted(n for n in pkg_files if re.search(r"(^|/)(tests?/|conftest\.py$|test_[^/]*\.py$)", n))
    if testish:
        errors.append(f"tests in the wheel: {testish}")
    if f"{import_name}/py.typed" not in pkg_files:
        errors.append(f"{import_name}/py.typed missing (the package ships type hints)")
    data_files = sorted(n for n in pkg_files if not n.endswith(".py"))

    # imports and runtime paths, over every module of the wheel
    required: dict[str, list[str]] = {}
    optional: dict[str, list[str]] = {}
    paths: list[dict[str, Any]] = []
    stdlib = set(sys.stdlib_module_names)
    for n, b in sorted(pkg_files.items()):
        if not n.endswith(".py"):
            continue
        text = b.decode()
        for imp in imports_of(text, n):
            mod = imp["module"]
            if mod in stdlib or mod == import_name:
                continue
            where = f"{n}:{imp['line']}"
            (optional if imp["optional"] else required).setdefault(mod, []).append(where)
        for p in runtime_paths(text, n):
            p["module"] = f"{n}:{p['line']}"
            paths.append(p)
            if p["outside"]:
                errors.append(f"{n}:{p['line']} reads {p['path']}, outside the package: it is not in the wheel")
            elif p["path"] not in pkg_files and not any(f.startswith(p["path"] + "/") for f in pkg_files):
                errors.append(f"{n}:{p['line']} reads {p['path']}, which is not in the wheel")
    for mod, where in sorted(required.items()):
        if distribution_of(mod) not in declared_names:
            errors.append(f"imports {mod!r} ({', '.join(where[:3])}{', ...' if len(where) > 3 else ''}) but "
                          f"does not declare {distribution_of(mod)!r} in [project] dependencies")
    imported = {distribution_of(m) for m in [*required, *optional]}
    unused = sorted(declared_names - imported)
    if unused:
        warnings.append(f"declares {unused} but no module imports them")
    for extra_name, reqs in project.get("optional-dependencies", {}).items():
        never = sorted({requirement_name(r) for r in reqs} - imported)
        if extra_name != "test" and never:
            warnings.append(f"extra [{extra_name}] installs {never}, which no module imports")

    # console scripts
    scripts = project.get("scripts", {})
    wheel_scripts = _entry_points(entry_points_txt).get("console_scripts", {})
    if wheel_scripts != scripts:
        errors.append(f"console_scripts {wheel_scripts} != [project.scripts] {scripts}")
    for script, target in scripts.items():
        module, _, attr = target.partition(":")
        mod_file = module.replace(".", "/")
        text = pkg_files.get(mod_file + ".py") or pkg_files.get(mod_file + "/__init__.py")
        if text is None:
            errors.append(f"console script {script} = {target}: module {module} is not in the wheel")
        elif attr and not _defines(text.decode(), attr.split(".")[0]):
            errors.append(f"console script {script} = {target}: {module} defines no {attr}")

    return {
        "package": name, "version": version, "wheel": wheel.name, "files": len(pkg_files), "data_files": data_files,
        "requires_dist": requires, "imports": {"required": sorted(required), "optional": sorted(optional)},
        "runtime_paths": paths, "console_scripts": scripts, "errors": errors, "warnings": warnings,
    }


def compare_sdist(pkg_dir: Path, wheel: Path, out_dir: Path) -> list[str]:
    """Build the sdist, then a wheel from it: the same files (same bytes) and METADATA as the direct wheel."""
    sdist = build(pkg_dir, out_dir / "sdist", kind="sdist")
    rebuilt = build(sdist, out_dir / "from-sdist", kind="wheel")
    a, meta_a, _, _ = read_wheel(wheel)
    b, meta_b, _, _ = read_wheel(rebuilt)
    errors = []
    only_a = sorted(n for n in set(a) - set(b) if not n.endswith("RECORD"))
    only_b = sorted(n for n in set(b) - set(a) if not n.endswith("RECORD"))
    if only_a or only_b:
        errors.append(f"wheel from the sdist: missing {only_a}, extra {only_b}")
    differ = sorted(n for n in set(a) & set(b) if a[n] != b[n] and not n.endswith("RECORD"))
    if differ:
        errors.append(f"wheel from the sdist: files differ {differ}")
    if meta_a.as_string() != meta_b.as_string():
        errors.append("wheel from the sdist: METADATA differs")
    return errors


def run(root: Path, names: list[str] | None, out_dir: Path, wheel_dir: Path | None, sdist: bool) -> dict[str, Any]:
    siblings = sibling_versions(root)
    report: dict[str, Any] = {"root": str(root), "packages": {}}
    for pkg_dir in find_packages(root, names):
        if wheel_dir is not None:
            project = read_project(pkg_dir)["project"]
            stem = f"{project['name'].replace('-', '_')}-{project['version']}-"
            found = sorted(wheel_dir.glob(f"{stem}*.whl"))
            if not found:
                report["packages"][pkg_dir.name] = {"errors": [f"no {stem}*.whl in {wheel_dir}"], "warnings": []}
                continue
            wheel = found[0]
        else:
            wheel = build(pkg_dir, out_dir / pkg_dir.name)
        result = check_wheel(pkg_dir, wheel, siblings)
        if sdist:
            result["errors"] += compare_sdist(pkg_dir, wheel, out_dir / pkg_dir.name)
        report["packages"][pkg_dir.name] = result
    report["ok"] = not any(r["errors"] for r in report["packages"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    ap.add_argument("--packages", nargs="*", metavar="NAME", help="package folder names (default: all)")
    ap.add_argument("--out-dir", type=Path, help="where the wheels go (default: a temporary folder, removed)")
    ap.add_argument("--wheel-dir", type=Path, help="check the wheels already in this folder; build nothing")
    ap.add_argument("--sdist", action="store_true", help="also build each sdist and a wheel from it; compare")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.out_dir is not None:
        report = run(root, args.packages, args.out_dir, args.wheel_dir, args.sdist)
    else:
        with tempfile.TemporaryDirectory(prefix="check_wheels-") as tmp:
            report = run(root, args.packages, Path(tmp), args.wheel_dir, args.sdist)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
