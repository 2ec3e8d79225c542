"""Building the peer of benchmarks/vs_llamacpp.py: C++ ``llama-server`` from the llama.cpp sources
vendored in the ``llama-cpp-python`` sdist on PyPI (MIT; version pinned in ``LLAMA_CPP_PYTHON_VERSION``):
``pip download`` the sdist into ``out/llamacpp/``, unpack it, cmake (Release, static, no curl/OpenSSL/web
UI/tests/examples) and build only the ``llama-server`` target, for this CPU (``native``: ggml's
GGML_NATIVE) or for AVX2 only (``x86-64-v3``: GGML_NATIVE off, which turns on exactly SSE4.2, AVX,
AVX2, BMI2, FMA and F16C, and AVX-512 off: the build most users' CPUs run, measured on a machine that
has more). The binary stays in ``out/llamacpp/build/bin/`` (native)
or ``out/llamacpp/build-x86-64-v3/bin/`` and later runs reuse it; a file lock keeps two builds from
running at once.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agentrt.bench.llamacpp_sdist import LLAMA_CPP_PYTHON_VERSION, llama_cpp_source  # noqa: E402

BUILD_ROOT = REPO / "out" / "llamacpp"
CMAKE_FLAGS = [
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",                                   # no HTTPS model downloads needed
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",   # no npm, no web UI download
    # the sdist has no git history: without this, llama.cpp takes the commit of the repo around out/
    f"-DLLAMA_BUILD_COMMIT=llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}", "-DLLAMA_BUILD_NUMBER=0",
]
# the CPU target: ggml's own flags for each (x86-64-v3 = what GGML_NATIVE=OFF enables by default, spelled out)
TARGET_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "x86-64-v3": ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON",
                  "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
}


def cmake_flags(target: str = "native") -> list[str]:
    """The cmake flags of a build for ``target`` (a key of ``TARGET_FLAGS``)."""
    return [*CMAKE_FLAGS, *TARGET_FLAGS[target]]


def build_dir(root: Path, target: str) -> Path:
    return root / ("build" if target == "native" else f"build-{target}")

def _run_logged(cmd: list[str], log) -> None:
    log.write(("\n$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def build_llama_server(root: Path = BUILD_ROOT, jobs: int = 2, target: str = "native") -> Path:
    """``llama-server`` built for ``target`` from the pinned llama-cpp-python sdist under ``root`` (cached)."""
    if target not in TARGET_FLAGS:
        raise ValueError(f"llama-server target {target!r}: one of {', '.join(TARGET_FLAGS)}")
    build = build_dir(root, target)
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / "build.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another llama-server build holds {root / 'build.lock'}: wait for it to finish")
    if binary.exists():                      # another run finished it just before we locked
        lock.close()
        return binary
    log_path = root / "build.log"
    started = time.perf_counter()
    with lock, open(log_path, "ab") as log:
        try:
            if not (root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz").exists():
                print(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (sdist) ...", flush=True)
            src = llama_cpp_source(root, log)
            print(f"building llama-server for {target} with -j{jobs} (log: {log_path}) ...", flush=True)
            _run_logged(["cmake", "-S", str(src), "-B", str(build), *cmake_flags(target)], log)
            _run_logged(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], log)
        except (subprocess.CalledProcessError, OSError, tarfile.TarError) as exc:
            log.flush()
            tail = log_path.read_text(errors="replace")[-4000:]
            sys.exit(f"{tail}\nbuilding llama-server failed ({exc}); full log: {log_path}")
    if not binary.exists():
        sys.exit(f"the build finished but {binary} is missing; log: {log_path}")
    print(f"built {binary} in {time.perf_counter() - started:.0f} s", flush=True)
    return binary



def llama_server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    return (out.stdout + out.stderr).strip()
