"""C kernels for the CPU, compiled on first use by the system C compiler and cached.

Like FlashInfer's kernels with nvcc, a C source that ships in the package is compiled the first time
it is needed, by ``$CC`` (else ``cc``/``gcc``) with ``-O3 -march=native -fopenmp`` (``FLAGS``; the target
``$AGENTRT_KERNEL_MARCH`` instead of ``native`` where set: ``x86-64-v3`` builds for AVX2 only, the CPU
most users have, on a machine that has more, to measure or to ship one build to a mixed fleet), into
``$AGENTRT_KERNEL_CACHE`` (default ``~/.cache/agentrt/kernels``), keyed by the source, the headers
it may include (``engine/csrc/*.h``, on the include path), the flags, the compiler's version and the
CPU's feature flags (a library built with -march=native for one CPU can crash on another that shares
the cache). Builds go to a temporary file renamed into place, under a lock file per library
(``fcntl.flock``): processes that need one library at once build it once, the others wait for it and load
it (the test suite's processes and servers all start on an empty cache on a fresh machine). OpenMP in these libraries binds to the libgomp torch has
already loaded: one thread pool.

Users: engine/attention/cpu_kernel.py (decode attention; RoPE and the K/V write), engine/models/cpu_ops.py
(residual add and RMSNorm; SiLU-multiply), engine/models/qmatmul.py (matmuls on GGUF blocks),
engine/models/decode_step.py (a bfloat16 or float32 decode step's layers, calling the others' functions by address),
engine/loader/gguf_file.py (GGUF blocks to float32 at load).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.cpu_info import flags_line

# reassociation lets the dot products and sums vectorise (1.7x); infinities and NaNs keep their meaning
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-fPIC", "-shared", "-std=gnu11")


# headers every kernel may include (kernel_math.h): on the include path, and in the cache key
INCLUDE_DIR = Path(__file__).resolve().parent / "csrc"

MARCH_ENV = "AGENTRT_KERNEL_MARCH"
_MARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def kernel_march() -> str:
    """The ``-march`` target of the kernels: ``$AGENTRT_KERNEL_MARCH`` (e.g. ``x86-64-v3``: AVX2 and FMA,
    no AVX-512) or ``native``. A value that is no target name is refused, naming the variable."""
    value = os.environ.get(MARCH_ENV, "native").strip() or "native"
    if not _MARCH.fullmatch(value):
        raise ValueError(f"{MARCH_ENV}={value!r} is not a -march target name (e.g. native, x86-64-v3, "
                         f"x86-64-v4, znver4)")
    return value


def kernel_flags() -> tuple[str, ...]:
    """``FLAGS`` with ``-march=`` set to :func:`kernel_march`."""
    march = kernel_march()
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def cache_dir() -> Path:
    root = os.environ.get("AGENTRT_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrt" / "kernels"


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` where it names one on PATH (or a path), else ``cc`` or ``gcc``."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def no_compiler_reason() -> str | None:
    """Why no kernel can be built here (no C compiler on PATH), or ``None`` when one is: the one
    reason the kernel tests may skip for; a compiler that fails on a source is an error, not this."""
    if compiler() is not None:
        return None
    cc = os.environ.get("CC")
    where = f"CC={cc!r} is not on PATH" if cc else "neither cc nor gcc is on PATH"
    return f"no C compiler: {where} (shutil.which found none)"


# the C libraries: engine/attention/cpu_kernel.py (decode and prefill attention), engine/models/cpu_ops.py,
# engine/models/qmatmul.py, engine/models/decode_step.py (a decode step's layers in one call); and one that is
# torch's own, picked the same way: oneDNN's packed float32 linear (engine/models/packed_linear.py)
KERNELS = ("decode_attention", "prefill_attention", "layer_ops", "qmatmul", "decode_step", "packed_linear")


@functools.cache   # once a process: every kernel library's cache key asks for it
def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library for ``source`` (built now unless cached); raises ``RuntimeError`` when it
    cannot be. ``extra_flags`` follow ``FLAGS`` (the tests build the portable path with
    ``-mno-avx512bf16``)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError(no_compiler_reason() or "no C compiler")
    flags = (*kernel_flags(), *extra_flags)
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h")))
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), _version(cc).encode(),
                                     platform.machine().encode(), flags_line().encode()])).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # released when the file closes, by the kernel if this process dies
        if out.exists():                        # another process built it while this one waited
            return out
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)   # built aside, renamed in: a reader never
        os.close(fd)                                                # sees half a library
        try:
            proc = subprocess.run([cc, *flags, f"-I{INCLUDE_DIR}", str(source), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out
