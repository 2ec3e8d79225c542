"""llama.cpp's copies of the model families' chat templates, read from the pinned llama-cpp-python sdist
(``agentrt.bench.llamacpp_sdist``) cached under ``out/llamacpp/`` and downloaded once; never copied
into the repository. ``templates_dir()`` skips the calling test when PyPI cannot be reached; ``prefetch``
(tests/conftest.py, after collection) starts the download in the background when a selected test will read
them, so its ~30 s of network on a fresh machine overlap other tests instead of holding a test process idle."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from agentrt.bench.llamacpp_sdist import LLAMA_CPP_PYTHON_VERSION, chat_templates, templates_folder

ROOT = Path(__file__).resolve().parents[1] / "out" / "llamacpp"


def templates_dir() -> Path:
    try:
        return chat_templates(ROOT)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} could not be downloaded from PyPI "
                    f"(pip exited {exc.returncode}): the chat templates are read from its sdist")


def prefetch(items: list[pytest.Item]) -> threading.Thread | None:
    """Download and unpack the templates in a background thread when one of ``items`` comes from a module
    that reads them (it imports ``templates_dir``) and they are not here yet; the thread, or None. Not a
    daemon: a test process that ends first waits for it rather than leave pip half done. Two test
    processes may both start one: the sdist module's lock file lets one download, the other then finds it."""
    if templates_folder(ROOT).is_dir():
        return None
    if not any(getattr(getattr(item, "module", None), "templates_dir", None) is templates_dir for item in items):
        return None
    thread = threading.Thread(target=_fetch, name="llama-cpp-python sdist", daemon=False)
    thread.start()
    return thread


def _fetch() -> None:
    try:
        chat_templates(ROOT)
    except Exception:   # noqa: BLE001 - the test that reads them calls chat_templates again and reports or skips
        pass
