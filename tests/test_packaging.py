"""Packaging and layering rules (docs/architecture.md, "Layers").

- `import operator` from the repo root must find the standard library, not our operator/.
- The built wheel contains every package folder (an editable or symlinked install hides a
  missing one).
- Layering: the import contracts in pyproject.toml (`[tool.importlinter]`: the rooms of the
  runtime and the operator, the product never imports the bench, kernels import nothing of
  ours, the operator shares only `tokenlane.runtime.config`) hold; and that module, the CLI and
  every operator module really import without torch (the operator image does not ship it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> import package, as mapped in pyproject.toml
TOP_LEVEL = {
    "cli": "tokenlane",
    "runtime": "tokenlane.runtime",
    "bench": "tokenlane.bench",
    "kernels": "tokenlane.kernels",
    "operator": "tokenlane.operator",
}


def _package_dirs() -> dict[str, str]:
    """Every folder under the mapped roots that holds Python modules -> its import package."""
    found = dict(TOP_LEVEL)
    for folder, package in TOP_LEVEL.items():
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.parent.relative_to(ROOT / folder)
            if rel != Path(".") and "__pycache__" not in rel.parts:
                found[(Path(folder) / rel).as_posix()] = ".".join([package, *rel.parts])
    return found


PACKAGE_DIRS = _package_dirs()
# Listed packages that hold data only (no __init__.py): the native kernels' C sources, which
# a JIT build on the user's host compiles (setuptools ships a folder's data only if it is listed).
DATA_PACKAGES = {"kernels/csrc": "tokenlane.kernels.csrc"}


def _run(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_operator_folder_has_no_init():
    # A regular package here would shadow the standard library whenever the root is on
    # sys.path (`python -m pytest` from the root crashes inside `collections`).
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_stdlib_operator_wins_with_repo_root_on_sys_path():
    # `python -c` puts the current directory first on sys.path, as `python -m pytest` does.
    result = _run(
        "import sys, operator, collections; assert sys.path[0] in ('', '.'), sys.path[0];"
        "assert hasattr(operator, 'itemgetter'), operator;"
        "print(getattr(operator, '__file__', 'builtin'))"
    )
    assert result.returncode == 0, result.stderr
    assert str(ROOT / "operator") not in result.stdout


def test_python_m_pytest_from_root_collects(tmp_path):
    # The trap in its original form: pytest launched as a module from the repo root.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_packaging.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_package_folder_is_mapped_in_pyproject():
    import tomllib

    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools_cfg["package-dir"]
    # Every folder holding Python modules is a listed package; subpackages follow their
    # top-level folder's mapping.
    assert sorted(setuptools_cfg["packages"]) == sorted([*PACKAGE_DIRS.values(), *DATA_PACKAGES.values()])
    assert {v: k for k, v in mapping.items()} == TOP_LEVEL
    for folder, package in PACKAGE_DIRS.items():
        if folder not in TOP_LEVEL:
            assert (ROOT / folder / "__init__.py").exists(), f"{folder}/ has no __init__.py"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in-tree and never prunes build/lib: a stale copy of a module that is
    # no longer packaged would make the wheel look complete.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (path,) = out.glob("tokenlane-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_contains_every_module_and_console_script(wheel):
    names = set(wheel.namelist())
    for folder, package in PACKAGE_DIRS.items():
        for py in (ROOT / folder).glob("*.py"):
            expected = package.replace(".", "/") + "/" + py.name
            assert expected in names, f"wheel lacks {expected}"
    assert "tokenlane/operator/__init__.py" not in names
    for folder, package in DATA_PACKAGES.items():
        sources = sorted(p.name for p in (ROOT / folder).iterdir() if p.suffix in (".c", ".h"))
        assert sources and all(f"{package.replace('.', '/')}/{name}" in names for name in sources), folder
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tokenlane = tokenlane.cli:main" in wheel.read(entry_points).decode()


def test_import_contracts_hold():
    # The rooms and the layering, as stated in pyproject.toml and checked by import-linter.
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lint_imports.py")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_import_contracts_catch_a_violation(tmp_path, monkeypatch):
    # A contract that cannot fail proves nothing: the product importing the bench breaks one.
    import importlib.util

    spec = importlib.util.spec_from_file_location("lint_imports", ROOT / "scripts" / "lint_imports.py")
    lint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lint)
    staged = lint.stage(tmp_path / "src")
    scheduler = staged / "tokenlane" / "runtime" / "core" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\nimport tokenlane.bench.report\n")
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), str(ROOT / "pyproject.toml"), "--no-cache"],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "src")},
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "tokenlane.runtime.core.scheduler -> tokenlane.bench.report" in result.stdout


def test_config_and_operator_import_without_torch():
    modules = ["tokenlane.runtime.config", "tokenlane.cli"] + [
        "tokenlane.operator." + ".".join(py.relative_to(ROOT / "operator").with_suffix("").parts)
        for py in sorted((ROOT / "operator").rglob("*.py")) if py.stem != "__init__"
    ]
    code = (
        "import sys\n"
        "for blocked in ('torch', 'triton', 'transformers'):\n"
        "    sys.modules[blocked] = None  # any import of these now raises ImportError\n"
        "import importlib\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    result = _run(code, cwd=Path("/"))
    assert result.returncode == 0, result.stderr


def test_console_script_help():
    result = subprocess.run(
        [sys.executable, "-m", "tokenlane.cli", "--help"], capture_output=True, text=True,
        timeout=60, cwd="/",
    )
    assert result.returncode == 0
    for command in ("serve", "operator", "render", "bench", "make-tiny-model"):
        assert command in result.stdout
