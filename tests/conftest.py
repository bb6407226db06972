"""Shared fixtures: tiny models made from configs (the shapes in :mod:`lit_dllm.testing`), offline."""

import collections
import os
import re
import signal

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `pytest -n N`'s workers: one thread each, subprocesses too (N
    os.environ["OMP_NUM_THREADS"] = "1"   # workers of a thread per core each would crawl on N cores)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from lit_dllm.testing import TINY_LLAMA  # noqa: E402  (after the settings above: it imports transformers)

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test may reach a hub, even where HF_HUB_OFFLINE was unset when the libraries were imported."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture
def tiny_llama():
    return dict(TINY_LLAMA)


@pytest.fixture
def default_sigint():
    """Ctrl+C as in a terminal, also where the test runner was started in the background (SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def sigterm_raises():
    """SIGTERM raises instead of killing the test runner wherever no handler of the code under test catches it."""

    def terminated(signum, frame):
        raise RuntimeError("SIGTERM reached the default handler")

    previous = signal.signal(signal.SIGTERM, terminated)
    yield
    signal.signal(signal.SIGTERM, previous)


_GPU_REASON = re.compile(r"\b(CUDA|GPU)\b")


def pytest_collection_modifyitems(items):
    """Mark every GPU test ``gpu``, so that ``pytest -m gpu`` runs them all in one process: a test of a ``*_cuda.py``
    file, or one that a ``skipif`` skips for want of CUDA (its reason names CUDA or a GPU, not "without"). Mark the
    notebooks' tests ``notebook``.

    Order the files for ``make test``'s ``pytest -n N --dist loadfile --no-loadscope-reorder``: the notebooks' first
    (the longest unit of work, ~5 min, would otherwise run on alone at the end: pytest-xdist's own order is by number
    of tests), then the others by number of tests, most first."""
    for item in items:
        if item.path.stem.startswith("test_notebook"):
            item.add_marker(pytest.mark.notebook)
        reasons = [mark.kwargs.get("reason", "") for mark in item.iter_markers("skipif")]
        if item.path.stem.endswith("_cuda") or any(
                _GPU_REASON.search(reason) and "without" not in reason for reason in reasons):
            item.add_marker(pytest.mark.gpu)
    tests_in = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (not item.get_closest_marker("notebook"), -tests_in[item.path]))  # a file stays whole
