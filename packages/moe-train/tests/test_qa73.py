"""QA pass 73: each library package installed alone, as a user of another training stack installs it.

Each package was installed by itself into a fresh virtual environment (with only the workspace folders
its pyproject names), its modules imported and its README run. What that found, checked here from the
source tree (no environment is built):

- moe-train imports `safetensors` and `huggingface_hub` at module level (`moe_train.hf_bridge`) but did not
  declare them: it got them only because moe-ckpt declared `huggingface-hub`, a package moe-ckpt itself
  never imports, so a standalone `pip install ./packages/moe-ckpt` pulled huggingface-hub and its HTTP
  stack for nothing.
- moe-precision declared `moe-kernels==0.7.2` and never imports it, so installing moe-precision alone
  failed ("no version of moe-kernels==0.7.2": the workspace folder is not on PyPI) unless the user also
  found the moe-kernels folder, and every moe-kernels bump forced a moe-precision release.
- Only moe-kernels shipped `py.typed`: type checkers ignored the other packages' hints.
- moe_ckpt had no `__version__` (every other package has one, equal to its pyproject's).
- Only moe-kernels declared a `test` extra: the others' tests need pytest, which nothing declares, and
  moe-parallel's tests call `torch.distributed.all_gather_object`, which (torch 2.15) goes through numpy:
  with moe-parallel and pytest alone, test_runtime_qa.py errored 19 times with "Numpy is not available".
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

PACKAGES_DIR = Path(__file__).resolve().parents[2]
PACKAGES = ("moe-kernels", "moe-parallel", "moe-precision", "moe-ckpt", "moe-train")
# distribution name -> import name, where they differ beyond "-" -> "_"
IMPORT_NAME = {"pyyaml": "yaml", "nvshmem4py-cu13": "nvshmem", "transformer-engine": "transformer_engine"}
GUARD_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "Exception"}
LIBRARIES = ("moe-kernels", "moe-parallel", "moe-precision", "moe-ckpt")  # used without moe-train
# torch.distributed's object collectives pickle through numpy (`tensor.numpy()`), which torch does not require
OBJECT_COLLECTIVE = re.compile(r"\b(all_gather_object|broadcast_object_list|gather_object|scatter_object_list"
                               r"|send_object_list|recv_object_list)\b")


def _project(package: str) -> dict:
    return tomllib.loads((PACKAGES_DIR / package / "pyproject.toml").read_text())["project"]


def _import_name(requirement: str) -> str:
    dist = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0).lower().replace("_", "-")
    return IMPORT_NAME.get(dist, dist.replace("-", "_").replace(".", "_"))


def _declared(package: str) -> tuple[set[str], set[str]]:
    """(import names of the required dependencies, import names of the optional extras)."""
    project = _project(package)
    required = {_import_name(r) for r in project.get("dependencies", [])}
    extras = {_import_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    return required, extras


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in GUARD_EXCEPTIONS for t in types)


def _imports(node: ast.AST, guarded: bool = False):
    """(import node, module name, guarded by try/except ImportError) for every absolute import under node."""
    if isinstance(node, ast.Try):
        body_guarded = guarded or any(_catches_import_error(h) for h in node.handlers)
        for child in node.body:
            yield from _imports(child, body_guarded)
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            yield from _imports(child, guarded)
        return
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield node, alias.name, guarded
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
        yield node, node.module, guarded
    for child in ast.iter_child_nodes(node):
        yield from _imports(child, guarded)


def _third_party_imports(package: str) -> list[tuple[str, str, bool]]:
    """(top-level module, "file:line", guarded) for every absolute import in src that is neither the standard
    library nor the package itself; lazy imports inside functions count."""
    own = package.replace("-", "_")
    src = PACKAGES_DIR / package / "src"
    found = []
    for path in sorted(src.rglob("*.py")):
        for node, name, guarded in _imports(ast.parse(path.read_text(), str(path))):
            top = name.split(".")[0]
            if top != own and top not in sys.stdlib_module_names:
                found.append((top, f"{path.relative_to(src)}:{node.lineno}", guarded))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_every_import_in_src_is_a_declared_dependency(package):
    """An unguarded import must name a dependency of this package (or, off the import path, one of its
    extras); getting it through another package's dependencies breaks the package installed alone."""
    required, extras = _declared(package)
    undeclared = sorted(
        f"{top} ({where})" for top, where, guarded in _third_party_imports(package)
        if not guarded and top not in required | extras
    )
    assert not undeclared, (
        f"{package} imports {', '.join(undeclared)} without declaring it in packages/{package}/pyproject.toml "
        f"(dependencies: {sorted(required)})"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_every_declared_dependency_is_imported_by_the_package(package):
    """A required dependency nothing in src imports costs a standalone user an install (for a workspace
    package, one that is not on PyPI at all) and a release of this package whenever it is bumped."""
    required, _ = _declared(package)
    imported = {top for top, _, _ in _third_party_imports(package)}
    unused = sorted(required - imported)
    assert not unused, (
        f"packages/{package}/pyproject.toml declares {', '.join(unused)}, which nothing in "
        f"packages/{package}/src imports; drop it (or move it to the package that imports it)"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_package_ships_py_typed_and_its_pyproject_version(package):
    module_dir = PACKAGES_DIR / package / "src" / package.replace("-", "_")
    assert (module_dir / "py.typed").is_file(), f"{module_dir}/py.typed is missing: type checkers ignore the hints"
    init = ast.parse((module_dir / "__init__.py").read_text())
    versions = [
        node.value.value for node in init.body
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
    ]
    assert versions == [_project(package)["version"]], (
        f"{module_dir}/__init__.py sets __version__ to {versions}, expected [{_project(package)['version']!r}]"
    )


@pytest.mark.parametrize("package", LIBRARIES)
def test_tests_need_only_the_package_and_its_test_extra(package):
    """`pip install "./packages/<pkg>[test]"` and `pytest packages/<pkg>/tests`, with nothing else installed,
    must not fail for a missing module (optional ones the tests skip without, via importorskip, aside)."""
    required, _ = _declared(package)
    test_extra = {_import_name(r) for r in _project(package).get("optional-dependencies", {}).get("test", [])}
    tests = PACKAGES_DIR / package / "tests"
    local = {p.stem for p in tests.glob("*.py")} | {package.replace("-", "_")}
    needed = {}
    for path in sorted(tests.glob("*.py")):
        text = path.read_text()
        skippable = set(re.findall(r"importorskip\(\s*[\"']([\w.]+)", text))
        for node, name, guarded in _imports(ast.parse(text, str(path))):
            top = name.split(".")[0]
            if not (guarded or top in skippable or top in local or top in sys.stdlib_module_names):
                needed.setdefault(top, f"{path.name}:{node.lineno}")
        if (m := OBJECT_COLLECTIVE.search(text)) and "numpy" not in skippable:
            needed.setdefault("numpy", f"{path.name} (torch.distributed.{m.group(1)} needs numpy)")
    missing = sorted(f"{top} ({where})" for top, where in needed.items() if top not in required | test_extra)
    assert not missing, (
        f"packages/{package}/tests need {', '.join(missing)}, which neither its dependencies nor a `test` extra "
        f"in packages/{package}/pyproject.toml declare (test extra: {sorted(test_extra)})"
    )
