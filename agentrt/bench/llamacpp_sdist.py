"""The pinned ``llama-cpp-python`` source package from PyPI (MIT): llama.cpp's sources, vendored.

``benchmarks/vs_llamacpp.py`` builds ``llama-server`` from it; the tests read llama.cpp's copies of
the model families' chat templates (``vendor/llama.cpp/models/templates/*.jinja``) from it. Both
fetch it once with ``pip download`` into ``out/llamacpp/`` and reuse the file from then on.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Iterator

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Holds ``root``'s lock file: one download or unpacking there at a time, across processes."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def download_sdist(root: Path, log: IO[bytes] | None = None) -> Path:
    """The sdist's path under ``root``, downloaded by pip if it is not there yet (raises
    ``subprocess.CalledProcessError`` when pip fails, e.g. with PyPI out of reach). One download at a time
    under ``root`` (a lock file: the tests start it in the background while a test may ask for it too), into
    a temporary folder first, so the file is there whole or not at all."""
    sdist = root / f"{SDIST_DIR}.tar.gz"
    if sdist.exists():
        return sdist
    with _locked(root):
        if sdist.exists():                       # the holder of the lock before us downloaded it
            return sdist
        with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp]
            if log is not None:
                log.write(("\n$ " + " ".join(cmd) + "\n").encode())
                log.flush()
            subprocess.run(cmd, stdout=log if log is not None else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                           check=True)
            os.replace(Path(tmp) / sdist.name, sdist)
    return sdist


def llama_cpp_source(root: Path, log: IO[bytes] | None = None) -> Path:
    """``vendor/llama.cpp`` of the sdist, unpacked under ``root`` (downloaded and unpacked once)."""
    src = root / SDIST_DIR / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        with tarfile.open(download_sdist(root, log)) as tar:
            tar.extractall(root, filter="data")
    return src


def templates_folder(root: Path) -> Path:
    """Where :func:`chat_templates` unpacks the templates under ``root`` (there or not yet)."""
    return root / SDIST_DIR / "vendor" / "llama.cpp" / "models" / "templates"


def chat_templates(root: Path) -> Path:
    """llama.cpp's folder of model chat templates (``*.jinja``), from the sdist under ``root`` (only
    that folder is unpacked when the sources are not; into a temporary folder first, then moved into
    place, so a reader sees all of them or none)."""
    folder = templates_folder(root)
    if folder.is_dir():
        return folder
    sdist = download_sdist(root)
    with _locked(root):
        if not folder.is_dir():
            prefix = f"{SDIST_DIR}/vendor/llama.cpp/models/templates"
            with tarfile.open(sdist) as tar, tempfile.TemporaryDirectory(dir=root, prefix=".unpack-") as tmp:
                members = [m for m in tar.getmembers() if m.name.startswith(prefix + "/")]
                tar.extractall(tmp, members=members, filter="data")
                folder.parent.mkdir(parents=True, exist_ok=True)
                os.replace(Path(tmp) / prefix, folder)
    return folder
