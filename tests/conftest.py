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
