"""What a user installing a package's wheel gets (QA 125): the runtime files, the declared imports, the console
script. tools/check_wheels.py builds each wheel with `uv build` and checks it without installing; the tests below
run it on every package and show, on scratch copies with a fault put in, that each check can fail."""

import ast
import importlib.util
import shutil
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_wheels", ROOT / "tools" / "check_wheels.py")
check_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_wheels)

pytestmark = pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv on PATH to build wheels")

PACKAGES = ("moe-kernels", "moe-parallel", "moe-precision", "moe-ckpt", "moe-train")
# Files each wheel must hold beyond its modules: what the code reads at run time, and py.typed.
RUNTIME_FILES = {
    "moe-kernels": ["moe_kernels/py.typed", "moe_kernels/triton/__init__.py"],
    "moe-parallel": ["moe_parallel/py.typed"],
    "moe-precision": ["moe_precision/py.typed"],
    "moe-ckpt": ["moe_ckpt/py.typed", "moe_ckpt/hf/remote_code/configuration_moe_train.py",
                 "moe_ckpt/hf/remote_code/modeling_moe_train.py"],
    "moe-train": ["moe_train/py.typed", "moe_train/cli.py"],
}
# Imports the scan must find in each package (outside the standard library and itself, unguarded): a scan that
# found nothing would pass every package; each one found must be declared (check_wheel's errors).
REQUIRED_IMPORTS = {
    "moe-kernels": ["torch", "triton"],
    "moe-parallel": ["moe_kernels", "torch"],
    "moe-precision": ["moe_kernels", "torch"],
    "moe-ckpt": ["numpy", "safetensors", "torch"],
    "moe-train": ["huggingface_hub", "moe_ckpt", "moe_kernels", "moe_parallel", "moe_precision", "numpy",
                  "safetensors", "tokenizers", "torch", "tqdm", "yaml"],
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    return {name: check_wheels.build(ROOT / "packages" / name, out / name) for name in PACKAGES}


@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_holds_its_runtime_files_and_declares_every_import(wheels, package):
    result = check_wheels.check_wheel(ROOT / "packages" / package, wheels[package],
                                      check_wheels.sibling_versions(ROOT))
    assert result["errors"] == [], result["errors"]
    names = set(zipfile.ZipFile(wheels[package]).namelist())
    assert set(RUNTIME_FILES[package]) <= names, sorted(set(RUNTIME_FILES[package]) - names)
    assert set(REQUIRED_IMPORTS[package]) <= set(result["imports"]["required"]), result["imports"]


@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_carries_the_repositorys_license_text(wheels, package):
    """Apache-2.0 4(a): a recipient gets a copy of the license. Each package keeps its own LICENSE (hatchling ships
    one found in the package's folder), the repository's text unchanged."""
    wheel = zipfile.ZipFile(wheels[package])
    licenses = [n for n in wheel.namelist() if ".dist-info/licenses/" in n]
    assert len(licenses) == 1, licenses
    assert wheel.read(licenses[0]).decode() == (ROOT / "LICENSE").read_text()


def test_moe_ckpt_wheel_ships_every_file_custom_code_exports_copy(wheels):
    """custom_code.REMOTE_CODE_FILES are copied from the installed package into each --custom-code export: a
    file named there but deleted from the source would pass the file-by-file comparison."""
    source = (ROOT / "packages/moe-ckpt/src/moe_ckpt/hf/custom_code.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "REMOTE_CODE_FILES" for t in n.targets))
    files = ast.literal_eval(node.value)
    assert files and {f"moe_ckpt/hf/remote_code/{f}" for f in files} <= set(
        zipfile.ZipFile(wheels["moe-ckpt"]).namelist())


def test_moe_train_wheel_declares_its_console_script(wheels):
    result = check_wheels.check_wheel(ROOT / "packages/moe-train", wheels["moe-train"])
    assert result["console_scripts"] == {"moe-train": "moe_train.cli:main"}
    ep = zipfile.ZipFile(wheels["moe-train"]).read(f"moe_train-{result['version']}.dist-info/entry_points.txt")
    assert b"moe-train = moe_train.cli:main" in ep


# ------------------------------------------------------------------------------- each check can fail
def _scratch(tmp_path: Path, package: str) -> Path:
    dst = tmp_path / package
    shutil.copytree(ROOT / "packages" / package, dst,
                    ignore=shutil.ignore_patterns("tests", "bench", "__pycache__", "CHANGELOG.md"))
    return dst


def _errors(pkg: Path, tmp_path: Path, siblings=None) -> list[str]:
    return check_wheels.check_wheel(pkg, check_wheels.build(pkg, tmp_path / "dist"), siblings)["errors"]


def test_check_catches_an_undeclared_import_at_module_level_and_in_a_function(tmp_path):
    pkg = _scratch(tmp_path, "moe-precision")
    recipe = pkg / "src/moe_precision/recipe.py"
    recipe.write_text(recipe.read_text() + textwrap.dedent("""
        import yaml


        def _load():
            import tokenizers
            return tokenizers


        try:
            import safetensors  # optional: guarded, so not an error
        except ImportError:
            safetensors = None
        """))
    errors = _errors(pkg, tmp_path)
    assert any("'yaml'" in e and "'pyyaml'" in e for e in errors), errors
    assert any("'tokenizers'" in e for e in errors), errors
    assert not any("safetensors" in e for e in errors), errors


def test_check_catches_a_data_file_left_out_of_the_wheel(tmp_path):
    pkg = _scratch(tmp_path, "moe-ckpt")
    pyproject = pkg / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(
        'packages = ["src/moe_ckpt"]', 'packages = ["src/moe_ckpt"]\nexclude = ["src/moe_ckpt/hf/remote_code"]'))
    errors = _errors(pkg, tmp_path)
    assert any("missing from the wheel" in e and "remote_code/modeling_moe_train.py" in e for e in errors), errors
    assert any("custom_code.py" in e and "moe_ckpt/hf/remote_code, which is not in the wheel" in e
               for e in errors), errors


def test_check_catches_a_path_outside_the_package_and_a_missing_data_file(tmp_path):
    pkg = _scratch(tmp_path, "moe-precision")
    cast = pkg / "src/moe_precision/cast.py"
    cast.write_text(cast.read_text() + textwrap.dedent("""
        TABLE = Path(__file__).parent / "tables" / "scales.json"
        SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "FACTS.md"
        """).replace("Path(", "__import__('pathlib').Path("))
    errors = _errors(pkg, tmp_path)
    assert any("moe_precision/tables/scales.json, which is not in the wheel" in e for e in errors), errors
    assert any("outside the package" in e and "shared/FACTS.md" in e for e in errors), errors


def test_check_catches_a_broken_console_script_and_tests_in_the_wheel(tmp_path):
    pkg = _scratch(tmp_path, "moe-precision")
    pyproject = pkg / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(
        "[build-system]", '[project.scripts]\nmoe-cast = "moe_precision.recipe:no_such_main"\n'
                          'moe-other = "moe_precision.cli:main"\n\n[build-system]'))
    (pkg / "src/moe_precision/tests").mkdir()
    (pkg / "src/moe_precision/tests/test_cast.py").write_text("def test_x():\n    pass\n")
    errors = _errors(pkg, tmp_path)
    assert any("moe-cast" in e and "defines no no_such_main" in e for e in errors), errors
    assert any("moe-other" in e and "moe_precision.cli is not in the wheel" in e for e in errors), errors
    assert any("tests in the wheel" in e and "moe_precision/tests/test_cast.py" in e for e in errors), errors


def test_check_catches_a_sibling_pin_the_workspace_has_moved_past(wheels):
    siblings = {**check_wheels.sibling_versions(ROOT), "moe-kernels": "99.0.0"}
    errors = check_wheels.check_wheel(ROOT / "packages/moe-parallel", wheels["moe-parallel"], siblings)["errors"]
    assert any("moe-kernels is at 99.0.0" in e for e in errors), errors


def test_imports_of_tells_required_from_optional():
    found = check_wheels.imports_of(textwrap.dedent("""
        import numpy
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import pandas
        try:
            import triton
        except (ImportError, RuntimeError):
            triton = None
        try:
            import yaml
        except ValueError:  # does not catch a missing module: still required
            pass
        def f():
            import importlib
            return importlib.import_module("tokenizers")
        """), "m.py")
    got = {(f["module"], f["where"], f["optional"]) for f in found}
    assert {("numpy", "module", False), ("pandas", "module", True), ("triton", "module", True),
            ("yaml", "module", False), ("tokenizers", "function", False)} <= got, got
