"""Bump one package's version, add a CHANGELOG heading, and keep every exact pin on it in step.
An "## Unreleased" section at the top of the CHANGELOG becomes the new version's (with --message
as its first entry when given).

usage: python tools/bump_version.py moe-kernels minor [--message "what changed"]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("major", "minor", "patch")


UNRELEASED = "## Unreleased\n"
DEFAULT_MESSAGE = "See the commit log."


def bumped(version: str, part: str) -> str:
    major, minor, patch = (int(x) for x in version.split("."))
    if part == "major":
        return f"{major + 1}.0.0"
    if part == "minor":
        return f"{major}.{minor + 1}.0"
    return f"{major}.{minor}.{patch + 1}"


def bump(package: str, part: str, message: str, root: Path = ROOT) -> str:
    pkg_dir = root / "packages" / package
    pyproject = pkg_dir / "pyproject.toml"
    if not pyproject.is_file():
        known = sorted(p.name for p in (root / "packages").iterdir() if (p / "pyproject.toml").is_file())
        raise SystemExit(f"package {package!r} not found; expected one of {', '.join(known)}")
    if part not in PARTS:
        raise SystemExit(f"part {part!r}: expected one of {', '.join(PARTS)}")
    text = pyproject.read_text()
    m = re.search(r'^version = "(\d+\.\d+\.\d+)"', text, re.M)
    if not m:
        raise SystemExit(f"{pyproject}: no version = \"X.Y.Z\" line")
    new = bumped(m.group(1), part)
    pyproject.write_text(text[: m.start(1)] + new + text[m.end(1) :])
    init = pkg_dir / "src" / package.replace("-", "_") / "__init__.py"
    if init.is_file():
        init.write_text(re.sub(r'__version__ = "[^"]+"', f'__version__ = "{new}"', init.read_text()))
    changelog = pkg_dir / "CHANGELOG.md"
    old = changelog.read_text() if changelog.is_file() else "# Changelog\n"
    head, _, rest = old.partition("\n\n")
    if rest.startswith(UNRELEASED):  # the entries gathered under "## Unreleased" become this release's
        entries = rest[len(UNRELEASED):]
        extra = "" if message == DEFAULT_MESSAGE else f"- {message}\n"
        changelog.write_text(f"{head}\n\n## {new}\n{extra}{entries}")
    else:
        changelog.write_text(f"{head}\n\n## {new}\n- {message}\n\n{rest}")
    for other in (root / "packages").glob("*/pyproject.toml"):
        t = other.read_text()
        t2 = re.sub(rf'"{re.escape(package)}==[^"]+"', f'"{package}=={new}"', t)
        if t2 != t:
            other.write_text(t2)
    return new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("package")
    p.add_argument("part", choices=PARTS)
    p.add_argument("--message", default=DEFAULT_MESSAGE)
    a = p.parse_args(argv)
    print(bump(a.package, a.part, a.message))
    return 0


if __name__ == "__main__":
    sys.exit(main())
