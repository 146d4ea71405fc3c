"""Packaging and layering rules (docs/architecture.md, "Layers").

- `import operator` from the repo root must find the standard library, not our operator/.
- The built wheel contains every package folder (an editable or symlinked install hides a
  missing one).
- Layering: kernels imports nothing of ours; operator imports nothing of runtime or kernels
  except `tokenlane.runtime.config`; that module and every operator module import without
  torch (the operator image does not ship it).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> import package, as mapped in pyproject.toml
PACKAGE_DIRS = {
    "cli": "tokenlane",
    "runtime": "tokenlane.runtime",
    "runtime/bench": "tokenlane.runtime.bench",
    "kernels": "tokenlane.kernels",
    "operator": "tokenlane.operator",
}


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
    assert sorted(setuptools_cfg["packages"]) == sorted(PACKAGE_DIRS.values())
    assert {v: k for k, v in mapping.items()} == PACKAGE_DIRS
    # Every folder holding Python modules under the mapped roots is itself mapped.
    for folder in ("cli", "runtime", "kernels", "operator"):
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.parent.relative_to(ROOT).as_posix()
            assert rel in PACKAGE_DIRS, f"{py} lives in {rel}/, which pyproject.toml does not map"


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
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tokenlane = tokenlane.cli:main" in wheel.read(entry_points).decode()


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_kernels_import_nothing_of_ours():
    for py in (ROOT / "kernels").rglob("*.py"):
        ours = {m for m in _imports(py) if m.startswith("tokenlane.")}
        assert all(m.startswith("tokenlane.kernels") for m in ours), (py, ours)


def test_operator_imports_only_the_runtime_config():
    for py in (ROOT / "operator").rglob("*.py"):
        for module in _imports(py):
            if module.startswith(("tokenlane.runtime", "tokenlane.kernels")):
                assert module.startswith("tokenlane.runtime.config"), f"{py.name} imports {module}"
            assert module.split(".")[0] not in ("torch", "triton", "transformers"), (py, module)


def test_config_and_operator_import_without_torch():
    modules = ["tokenlane.runtime.config", "tokenlane.cli"] + [
        f"tokenlane.operator.{py.stem}" for py in sorted((ROOT / "operator").glob("*.py"))
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
