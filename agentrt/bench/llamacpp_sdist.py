"""The pinned ``llama-cpp-python`` source package from PyPI (MIT): llama.cpp's sources, vendored.

``benchmarks/vs_llamacpp.py`` builds ``llama-server`` from it; the tests read llama.cpp's copies of
the model families' chat templates (``vendor/llama.cpp/models/templates/*.jinja``) from it. Both
fetch it once with ``pip download`` into ``out/llamacpp/`` and reuse the file from then on.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path
from typing import IO

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"


def download_sdist(root: Path, log: IO[bytes] | None = None) -> Path:
    """The sdist's path under ``root``, downloaded by pip if it is not there yet (raises
    ``subprocess.CalledProcessError`` when pip fails, e.g. with PyPI out of reach)."""
    sdist = root / f"{SDIST_DIR}.tar.gz"
    if sdist.exists():
        return sdist
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(root)]
    if log is not None:
        log.write(("\n$ " + " ".join(cmd) + "\n").encode())
        log.flush()
    subprocess.run(cmd, stdout=log if log is not None else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                   check=True)
    return sdist


def llama_cpp_source(root: Path, log: IO[bytes] | None = None) -> Path:
    """``vendor/llama.cpp`` of the sdist, unpacked under ``root`` (downloaded and unpacked once)."""
    src = root / SDIST_DIR / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        with tarfile.open(download_sdist(root, log)) as tar:
            tar.extractall(root, filter="data")
    return src


def chat_templates(root: Path) -> Path:
    """llama.cpp's folder of model chat templates (``*.jinja``), from the sdist under ``root`` (only
    that folder is unpacked when the sources are not)."""
    folder = root / SDIST_DIR / "vendor" / "llama.cpp" / "models" / "templates"
    if not folder.is_dir():
        prefix = f"{SDIST_DIR}/vendor/llama.cpp/models/templates/"
        with tarfile.open(download_sdist(root)) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(root, members=members, filter="data")
    return folder
