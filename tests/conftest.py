"""Fixtures shared across the test suite: the real agentrt server in a subprocess.

``agentrt_server`` is started once per test session (loading the model takes a while on
two cores) and shared; tests that need different limits call :func:`start_server` with
their own flags. Servers run with a small KV pool and low default token limits so the
whole suite stays fast. Processes start through ``agentrt.procs`` (the launcher ``agentrt up``
and the benchmarks use); a server is an ``agentrt.procs.Proc``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os

# Before torch is imported (here and in every server the tests start, which inherit the environment):
# OpenMP threads that sleep at a barrier instead of spinning. The suite runs an in-process engine beside
# server subprocesses on two cores; with spinning threads each process's parallel regions wait for a
# thread the other process's spinners keep off the CPU. Measured with one other busy process on this
# 2-core machine: engine start 20.2 s -> 3.6 s, a 500-token prefill 17.3 s -> 4.8 s, 32 decode steps
# 29.2 s -> 3.7 s. A user's explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# In pytest-xdist processes (make test runs two), each process's share of the cores as its thread count (and its
# servers'): two processes of two threads each on two cores took more CPU for the same work (tests/engine/
# test_overlap.py alone: 78.5 CPU-s in two threads, 65.4 in one, 59 s and 66 s of wall time).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, _share))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from agentrt.procs import Proc, Procs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Tests that use one of these start server processes (an agentrt server, redis-server, a cluster of
# workers and routers): they get the ``server`` mark, which ``make test-fast`` leaves out.
SERVER_FIXTURES = frozenset({"agentrt_server", "start_agentrt_server", "redis_server", "redis_url",
                             "redis_server_factory"})


def _starts_processes(module) -> bool:
    """Whether a test module builds its own processes: a cluster through tests/router/cluster.py, a server
    through :func:`start_server`, or an ``agentrt.procs.Procs`` group (its fixtures are its own, so the
    fixture names above do not show it)."""
    from tests.router import cluster
    return any(v is cluster or v is start_server or v is Procs for v in vars(module).values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or (module is not None and _starts_processes(module)):
            item.add_marker(pytest.mark.server)


def start_server(tmp_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Proc:
    """``python -m agentrt_cli serve`` on a free port, its log in ``tmp_dir``; returns once /health
    answers 200. The caller stops it (``stop()`` returns the exit code)."""
    server = Procs(tmp_dir, cwd=ROOT).agentrt("agentrt-serve", "serve", "--kv-cache-tokens", "16384",
                                              "--default-max-tokens", "16", "--log-level", "warning", *flags, env=env)
    return server.wait_ready()


@pytest.fixture(scope="session")
def agentrt_server(tmp_path_factory: pytest.TempPathFactory):
    """One real server for most API tests (default limits, no API keys)."""
    server = start_server(tmp_path_factory.mktemp("agentrt"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def start_agentrt_server():
    """``start_agentrt_server(tmp_dir, *flags)`` starts another server; the caller stops it."""
    return start_server


@pytest.fixture(autouse=True, scope="session")
def _default_model_files_read_once():
    """Every in-process engine of the default model (the tests build dozens: one per configuration) reads
    and dequantizes the same GGUF file; read it once per (dtype, 4-bit groups, block layers' dense weights or
    not) and hand each engine the same tensors, which building a model only reads: copies from, or shares
    read-only where a tensor is already the parameter (``copy_hf_weights``), or wraps read-only (the 4-bit
    blocks). Each engine still builds its own model, pool and runner from them, and gets a tokenizer of its own
    (a tokenizer keys its grammar compiler cache). Other paths load as before; the loader's own tests call it
    directly. Measured on this 2-core machine: a build after the first 2.8 s -> 0.7 s (0.22 s since weights are
    shared, not copied)."""
    import engine.builder as builder
    from engine.loader import load_tokenizer

    real, files = builder.load_model_files, {}

    def load_model_files(path, dtype=None, int4_groups=False, dense_blocks=True):
        if dtype is None:
            import torch
            dtype = torch.float32
        if path is not None:
            return real(path, dtype, int4_groups=int4_groups, dense_blocks=dense_blocks)
        key = dtype, int4_groups, dense_blocks
        if key not in files:
            files[key] = real(None, dtype, int4_groups=int4_groups, dense_blocks=dense_blocks)
        return files[key]._replace(tokenizer=load_tokenizer(None)[0])

    builder.load_model_files = load_model_files
    yield
    builder.load_model_files = real
    files.clear()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, the client SDKs, every test module: over half a million
    objects) lives for the whole session: move it into the permanent generation, out of the collector's walk,
    so that a full collection (the one below after each module, and the interpreter's own) walks only what
    the tests made. A full collection of the collected heap took 0.3-0.45 s, about 150 of them a run. The
    interpreter starts a full collection once its long-lived objects grew by a quarter, counting unfrozen ones
    only, so it would now run them often during a long generation: ten times the third threshold keeps them
    rare (measured on two test_speculative tests: 38.1 s unfrozen, 40.9 s frozen, 37.1 s frozen with it).
    First, llama.cpp's chat templates start downloading in the background if a selected test reads them
    (tests/llamacpp_templates.py ``prefetch``)."""
    from tests.llamacpp_templates import prefetch
    prefetch(session.items)
    gc.collect()
    gc.freeze()
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(g0, g1, 10 * g2)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` from the process's own symbols (None elsewhere: musl, macOS)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def _release_heap() -> None:
    """Hand the C heap's free pages back to the OS. Freed tensors that were not big enough for their own
    mapping stay in glibc's arenas (one per thread that allocated: the engine, forward and tier threads), so
    a process that built and dropped engines keeps their bytes: after tests/engine/test_cpu_ops.py (run after two
    other engine modules) the process held 7.65 GB, 4.13 GB once trimmed."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """After a module's last test: collect its engines and return their memory. An engine sits in reference
    cycles (its parts hold its bound methods), which only the cyclic collector frees, and it runs its oldest
    generation rarely. This runs after the protocol, not in a module fixture's teardown, because pytest drops
    the last test's fixture values (``item.funcargs``, which may hold the module's engine) only once its
    teardown is done: collected from a fixture, each module's engine lived on through the next module.
    Without this the one-process suite grew to 13.7 GB (peak RSS). What survives the collection is frozen too:
    what stays alive from module to module (the session's engines and servers, the modules a test imported:
    180,000 objects after tests/engine/test_parity.py, which imports transformers) would otherwise be walked by
    every later collection, 0.1-0.16 s at each module's end on a 2-core EPYC (~150 modules), 0-4 ms once frozen.
    A module's own engines are garbage by then and gone; refcounting still frees a frozen object, only a cycle
    that forms among frozen objects later would stay."""
    result = yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.collect()
        gc.freeze()
        _release_heap()
    return result
