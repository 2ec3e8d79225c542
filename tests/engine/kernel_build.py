"""The one reason the C kernel tests may skip: no C compiler on PATH (``engine.cpu_build.no_compiler_reason``,
which checks ``shutil.which``). With a compiler, a source that fails to build fails every test of the
file with the compiler's message; the product's ``load()`` would quietly fall back to torch instead."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from engine.cpu_build import no_compiler_reason


class KernelBuild:
    """``make()``'s library (built now), or why there is none: ``skip_reason`` (no compiler) or
    ``error`` (the build failed)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.value = self.error = None
        self.skip_reason = no_compiler_reason()
        if self.skip_reason is None:
            try:
                self.value = make()
            except (RuntimeError, OSError) as exc:
                self.error = exc

    def skip_mark(self) -> pytest.MarkDecorator:
        return pytest.mark.skipif(self.skip_reason is not None, reason=self.skip_reason or "")

    def require(self) -> None:
        """Fail the calling test when a compiler was there but the build failed."""
        if self.error is not None:
            pytest.fail(f"the C kernel did not build although a compiler is on PATH: {self.error}", pytrace=False)

    def autouse_require(self):
        """An autouse fixture calling ``require``; assigned in a test module (``_built = BUILD.autouse_require()``),
        a compile error fails every test there."""
        @pytest.fixture(autouse=True)
        def _built() -> None:
            self.require()
        return _built


def skip_off_x86_64(march: str) -> None:
    """Skip the calling test where ``march`` (e.g. ``x86-64-v3``) is an x86-64 target and this machine is not one."""
    import platform

    if march.startswith("x86-64") and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{march} is an x86-64 target; this machine is {platform.machine()}")


def built_for(march: str, make: Callable[[], Any]) -> Any:
    """``make()`` with the kernels built for ``-march=<march>`` (``AGENTRT_KERNEL_MARCH``, as a user sets it), e.g.
    ``x86-64-v3``: AVX2 and FMA only, as on most users' CPUs. Tests that ask for the same target share one build
    (the kernel cache keys it by its flags). Skipped off x86-64, where those targets do not exist."""
    import os

    from engine.cpu_build import MARCH_ENV

    skip_off_x86_64(march)
    before = os.environ.get(MARCH_ENV)
    os.environ[MARCH_ENV] = march
    try:
        return make()
    finally:
        if before is None:
            del os.environ[MARCH_ENV]
        else:
            os.environ[MARCH_ENV] = before
