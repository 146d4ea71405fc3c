"""Check the import contracts in pyproject.toml ([tool.importlinter]) against the source tree.

`lint-imports` walks an import package's folders, and skips a folder without `__init__.py`
inside a regular package: that is our `operator/`, which must have none (it would shadow the
standard library's `operator` whenever the repository root is on sys.path). So this script
lays the sources out as the installed package would be, in a temporary folder, gives the copy
of `operator/` an `__init__.py`, and runs `lint-imports` there.

Usage: python scripts/lint_imports.py  (exit status of lint-imports; run by the test suite)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stage(dest: Path) -> Path:
    """Copy every mapped package folder's Python files to dest/<import path>; returns dest."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for py in (ROOT / folder).glob("*.py"):
            shutil.copy2(py, target / py.name)
        init = target / "__init__.py"
        if not init.exists():
            init.write_text("")
    # Subpackages of a mapped folder are laid out by setuptools from the parent's mapping.
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if rel == Path("."):
                continue
            target = dest.joinpath(*package.split("."), rel)
            target.mkdir(parents=True, exist_ok=True)
            for py in init.parent.glob("*.py"):
                shutil.copy2(py, target / py.name)
    return dest


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tokenlane-lint-") as tmp:
        staged = stage(Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(staged)}
        lint = Path(sys.executable).with_name("lint-imports")
        command = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
        return subprocess.run(
            [*command, str(ROOT / "pyproject.toml"), "--no-cache"], env=env, cwd=tmp
        ).returncode


if __name__ == "__main__":
    sys.exit(main())
