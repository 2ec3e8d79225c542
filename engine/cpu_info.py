"""Facts about this machine's CPU, read once from ``/proc/cpuinfo`` (and the scheduler's affinity).

One reader for every user: the dtype default (``cpu_has_native_bf16``: engine/config.py), the C kernels'
build cache key (engine/cpu_build.py) and the machine a benchmark ran on (benchmarks/harness.py,
agentrt/bench/bench.py). ``cpuinfo`` arguments take the file's text, so tests can pass another CPU's.
"""

from __future__ import annotations

import os
import platform
from typing import Mapping

# the feature flags that decide which kernels and dtypes run fast here (recorded with every benchmark)
# The environment that runs this process as a CPU with AVX2 and no AVX-512 would, on one that has more: the C
# kernels built for x86-64-v3 (engine/cpu_build.py), torch's own kernels, oneDNN and MKL (torch's float32 GEMM)
# held to AVX2. MKL left alone runs its AVX-512 GEMM, which makes every matmul faster than on such a CPU.
AVX2_ONLY_ENV = {"AGENTRT_KERNEL_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                 "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "avx_vnni")


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _field(cpuinfo: str, *names: str) -> str | None:
    """The value of the first line that starts with one of ``names`` (the first CPU's)."""
    for line in cpuinfo.splitlines():
        if line.startswith(names):
            return line.partition(":")[2].strip()
    return None


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (``platform.processor()`` or the machine type where cpuinfo has none)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return _field(text, "model name") or platform.processor() or platform.machine() or "unknown"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """Every feature flag of the first CPU (x86 ``flags``, Arm ``Features``)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return set((_field(text, "flags", "Features") or "").split())


def flags_line(cpuinfo: str | None = None) -> str:
    """The flags line as written (a library built with -march=native is keyed by it)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return _field(text, "flags", "Features") or platform.processor()


def has_native_bf16(cpuinfo: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether this CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16) for torch: not where
    the process caps torch or oneDNN below AVX-512 (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` in
    ``env``, default ``os.environ``), as ``benchmarks/vs_llamacpp.py --cpu x86-64-v3`` does to run as an
    AVX2-only CPU would: there bf16 matmuls are emulated and float32 is the faster choice."""
    env = os.environ if env is None else env
    aten = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    onednn = env.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    capped = aten in ("default", "avx", "avx2", "no avx") or (onednn not in ("", "ALL") and not
                                                             onednn.startswith(("AVX512", "AVX10", "AMX")))
    return not capped and bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


def cores_usable() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_gib() -> float | None:
    """Physical memory in GiB (None where the system does not say)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict:
    """The machine as benchmark results record it."""
    flags = cpu_flags()
    return {"cpu_model": cpu_model(), "cores_usable": cores_usable(), "memory_gib": memory_gib(),
            "cpu_flags": [f for f in FLAGS_THAT_MATTER if f in flags]}
