import importlib.util
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bump_version", ROOT / "tools" / "bump_version.py")
bump_version = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bump_version)


def test_bump_updates_version_changelog_and_exact_pins(tmp_path):
    for pkg in ("moe-kernels", "moe-train"):
        dst = tmp_path / "packages" / pkg
        shutil.copytree(ROOT / "packages" / pkg, dst, ignore=shutil.ignore_patterns("tests", "bench", "__pycache__"))
    old = bump_version.re.search(r'version = "([^"]+)"', (tmp_path / "packages/moe-kernels/pyproject.toml").read_text()).group(1)
    new = bump_version.bump("moe-kernels", "minor", "faster", root=tmp_path)
    assert new == bump_version.bumped(old, "minor") and new != old
    assert f'version = "{new}"' in (tmp_path / "packages/moe-kernels/pyproject.toml").read_text()
    assert f'"moe-kernels=={new}"' in (tmp_path / "packages/moe-train/pyproject.toml").read_text()
    assert f"## {new}\n- faster" in (tmp_path / "packages/moe-kernels/CHANGELOG.md").read_text()
    assert f'__version__ = "{new}"' in (tmp_path / "packages/moe-kernels/src/moe_kernels/__init__.py").read_text()


def test_bump_turns_the_unreleased_section_into_the_release(tmp_path):
    dst = tmp_path / "packages" / "moe-kernels"
    shutil.copytree(ROOT / "packages" / "moe-kernels", dst, ignore=shutil.ignore_patterns("tests", "bench", "__pycache__"))
    changelog = dst / "CHANGELOG.md"
    changelog.write_text("# Changelog\n\n## Unreleased\n- gathered entry\n\n## 0.1.0\n- first\n")
    new = bump_version.bump("moe-kernels", "patch", bump_version.DEFAULT_MESSAGE, root=tmp_path)
    assert changelog.read_text() == f"# Changelog\n\n## {new}\n- gathered entry\n\n## 0.1.0\n- first\n"
    changelog.write_text("# Changelog\n\n## Unreleased\n- gathered entry\n\n## 0.1.0\n- first\n")
    new2 = bump_version.bump("moe-kernels", "patch", "summary", root=tmp_path)
    assert changelog.read_text() == f"# Changelog\n\n## {new2}\n- summary\n- gathered entry\n\n## 0.1.0\n- first\n"
