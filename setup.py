"""The build step pyproject.toml cannot declare: the native CPU kernels (kernels/csrc/*.c), one
shared library per instruction-set level, built into the package's `_native/` folder with a
manifest (kernels/native_build.py). The metadata is pyproject.toml's; this file only adds the
`build_native` command to `build` and marks the wheel as platform-specific.

    pip install .                                  # the wheel carries the libraries
    python setup.py build_native --inplace         # a checkout: into kernels/_native/

Without a C compiler the wheel still builds, with no library and a manifest that says why.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent


def _native_build():
    """kernels/native_build.py, loaded by path: importing the package would need its
    dependencies (torch) at build time."""
    spec = importlib.util.spec_from_file_location("_tokenlane_native_build", ROOT / "kernels" / "native_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class build_native(Command):
    description = "build the native CPU kernels, one library per instruction-set level"
    user_options = [("inplace", "i", "into kernels/_native/ of the checkout instead of the build folder")]
    boolean_options = ["inplace"]

    def initialize_options(self):
        self.inplace = False
        self.build_lib = None
        self.editable_mode = False

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self):
        native_build = _native_build()
        if self.inplace or self.editable_mode:
            out = ROOT / "kernels" / "_native"
        else:
            out = Path(self.build_lib) / "tokenlane" / "kernels" / "_native"
        manifest = native_build.build_all(out)
        built = ", ".join(manifest["levels"]) or f"none ({manifest['reason']})"
        for level, error in manifest["failed"].items():
            print(f"build_native: {level} not built: {error}", file=sys.stderr)
        print(f"build_native: {out}: {built}", file=sys.stderr)

    def get_outputs(self):
        return []


class BinaryDistribution(Distribution):
    """The wheel holds shared libraries: a platform wheel, not a pure one."""

    def has_ext_modules(self):
        return True


class platform_wheel(bdist_wheel):
    """py3-none-<platform>: the libraries are loaded with ctypes, so any Python 3 takes them."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class build_with_native(build):
    sub_commands = build.sub_commands + [("build_native", None)]


setup(
    distclass=BinaryDistribution,
    cmdclass={"build": build_with_native, "build_native": build_native, "bdist_wheel": platform_wheel},
)
