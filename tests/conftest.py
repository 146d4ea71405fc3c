"""Shared fixtures. Area fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# --import-mode=importlib does not put test folders on sys.path; property_examples (a unique
# name) is shared by the property tests of every area.
sys.path.insert(0, str(Path(__file__).parent))

import property_examples  # noqa: E402


def pytest_configure(config):
    if property_examples.selects_slow(config.option.markexpr):
        property_examples.thorough = True
    # Two cores: keep torch from oversubscribing when tests run next to servers.
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("TOKENLANE_TEST_TORCH_THREADS", "2")))
    except ImportError:
        pass


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """In the slow run every Hypothesis property is selected too, to run its thorough count."""
    if property_examples.selects_slow(config.option.markexpr):
        for item in items:
            if hasattr(getattr(item, "obj", None), "hypothesis"):
                item.add_marker(pytest.mark.slow)


def native_levels() -> list[str]:
    """The native levels the kernel tests run on this host: the level `load()` loaded, then each
    lower prebuilt level whose CPU flags this host has (an AVX-512 host thus also runs the AVX2
    build's code, which CI would otherwise only reach on an AVX2-only host). A developer build
    (TOKENLANE_NATIVE_JIT), or no library, gives just what was loaded: "loaded"."""
    from tokenlane.kernels import cpu_native, native_build

    library = cpu_native.loaded_library()
    if library is None or library.jit:
        return ["loaded"]
    built = (native_build.read_manifest(library.path.parent) or {}).get("levels") or {}
    flags = native_build.host_cpu_flags()
    names = [level.name for level in native_build.levels_for()]
    lower = [level.name for level in native_build.levels_for()[: names.index(library.level)]
             if level.name in built and level.cpu_flags <= flags]
    return [library.level] + lower[::-1]


def pytest_generate_tests(metafunc):
    if "native_level" in metafunc.fixturenames:
        metafunc.parametrize("native_level", native_levels(), indirect=True)


@pytest.fixture
def native_level(request, monkeypatch):
    """The test runs on the prebuilt native library of one level (`native_levels()`): the one
    loaded, or a lower one loaded for the test under TOKENLANE_NATIVE_MAX_LEVEL; the loaded one
    is put back afterwards. Yields the level's NativeLibrary (None when no library loads)."""
    from tokenlane.kernels import cpu_native

    loaded = cpu_native.loaded_library()
    if request.param == "loaded" or loaded.level == request.param:
        yield loaded
        return
    cpu_native.park_pool()  # the loaded library's helpers sleep while the other one runs
    monkeypatch.setenv(cpu_native.MAX_LEVEL_ENV, request.param)
    monkeypatch.delenv(cpu_native.JIT_ENV, raising=False)
    for name, fresh in (("_tried", False), ("_loaded", None), ("_library", None), ("_load_error", None)):
        monkeypatch.setattr(cpu_native, name, fresh)
    library = cpu_native.loaded_library()
    assert library is not None and library.level == request.param, cpu_native.load_error()
    yield library
    cpu_native.park_pool()  # before monkeypatch puts the loaded library back


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint with a real tokenizer (built once per session)."""
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """The Qwen2 variant (qkv bias, tied embeddings)."""
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (bitwise-stable CPU matmuls against references)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
