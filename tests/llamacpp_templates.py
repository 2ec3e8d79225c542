"""llama.cpp's copies of the model families' chat templates, read from the pinned llama-cpp-python sdist
(``agentrt.bench.llamacpp_sdist``) cached under ``out/llamacpp/`` and downloaded once; never copied
into the repository. ``templates_dir()`` skips the calling test when PyPI cannot be reached."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agentrt.bench.llamacpp_sdist import LLAMA_CPP_PYTHON_VERSION, chat_templates

ROOT = Path(__file__).resolve().parents[1] / "out" / "llamacpp"


def templates_dir() -> Path:
    try:
        return chat_templates(ROOT)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} could not be downloaded from PyPI "
                    f"(pip exited {exc.returncode}): the chat templates are read from its sdist")
