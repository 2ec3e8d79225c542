"""The packages are floors (docs/architecture.md, "Layers"): reads every module's imports with
``ast`` and fails on an import cycle or an import that goes the wrong way.

* ``engine`` imports nothing of ours above it (no ``agentrt``, no ``router``);
* ``agentrt`` (the serving core) does not import ``router``;
* inside ``agentrt``, the surfaces (``agentrt.api``: OpenAI, Responses, Anthropic Messages) stand side by
  side on ``agentrt.core`` (generation, turns, store, tenants, leases, message conversion): no surface
  imports another, and nothing in ``agentrt.core`` imports a surface or the app (``agentrt.server``);
* ``router`` uses ``agentrt`` only through the modules named in ``ROUTER_USES`` (the app it assembles,
  the settings, the contracts it implements: store, tenants, errors), never a surface's or the turn
  path's internals;
* ``agentrt_cli`` (the ``agentrt`` command, dispatching to every subcommand) stands above both, and
  nothing of ours imports it;
* nothing in the installed packages imports ``benchmarks`` or ``tests`` (scripts and tests
  import the package, never the other way);
* no two modules of the packages import each other, directly or round a longer circle.

Imports inside functions count (a lazy import hides a circle, it does not remove it); those
under ``if TYPE_CHECKING:`` do not count for the floors (they never run), but close no circle
either (a type-only loop is the same tangle, hidden).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "agentrt", "router", "agentrt_cli")
OURS = PACKAGES + ("benchmarks", "tests")
# agentrt's modules router/ may import: the app it assembles (server), its settings and instrumentation,
# the contracts it implements or reuses (the session store, tenants, errors and the request-field checks of
# its SGLang /generate), the SSE plumbing, the dashboard's status shape, the process launcher and the way
# a task is stopped (agentrt.core.tasks)
ROUTER_USES = frozenset({"agentrt", "agentrt.server", "agentrt.config", "agentrt.tracing", "agentrt.metrics",
                         "agentrt.procs", "agentrt.dashboard", "agentrt.api.http", "agentrt.core.errors",
                         "agentrt.core.request_fields", "agentrt.core.tasks", "agentrt.core.tenants",
                         "agentrt.core.store"})


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of ours (packages, benchmarks, tests)."""
    out = {}
    for top in OURS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, type_only: bool = False):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path], type_only: bool = False) -> set[str]:
    """The modules of ours that ``name`` imports (``from pkg import sub`` is an import of ``pkg.sub``);
    ``type_only``: those under ``if TYPE_CHECKING:`` too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_only):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a function or class: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules, type_only) for name, path in modules.items()
            if name.split(".")[0] in PACKAGES}


def forbidden(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported`` (None: it may)."""
    low, high = importer.split(".")[0], imported.split(".")[0]
    if high in ("benchmarks", "tests"):
        return f"the package imports {high}/ (scripts and tests build on the package, not the reverse)"
    if low == "engine" and high in ("agentrt", "router"):
        return "engine/ imports nothing of ours above it"
    if low == "agentrt" and high == "router":
        return "the serving core (agentrt/) does not import the multi-worker layer (router/)"
    if low == "router" and high == "agentrt" and imported not in ROUTER_USES:
        return "router/ reaches into agentrt beyond the modules it may use (ROUTER_USES)"
    if high == "agentrt_cli" and low != "agentrt_cli":
        return "nothing imports the command (agentrt_cli/): it stands above every package"
    if importer.startswith("agentrt.core") and (imported.startswith("agentrt.api") or imported == "agentrt.server"):
        return "agentrt.core builds no surface: the surfaces (agentrt.api) and the app stand on it"
    if importer.startswith("agentrt.api.") and imported.startswith("agentrt.api.") and \
            _surface(imported) != "*" and _surface(importer) != _surface(imported):
        return "a surface imports another: what both need belongs in agentrt.core (or agentrt.api.http)"
    return None


def _surface(module: str) -> str:
    """The surface a module of ``agentrt.api`` belongs to (``responses_output`` is the Responses API's);
    ``agentrt.api.http``, the plumbing every surface uses, is none (``*``)."""
    name = module.split(".")[2]
    return "*" if name == "http" else name.removesuffix("_output")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_goes_down_a_floor_the_wrong_way():
    graph = import_graph()
    bad = [f"{a} -> {b}: {why}" for a, targets in sorted(graph.items()) for b in sorted(targets)
           if (why := forbidden(a, b))]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_type_only_import_loops():
    """Imports for annotations only (``if TYPE_CHECKING:``) close no circle either: two modules that
    name each other's types belong together, or the type belongs in a module below both."""
    found = cycles(import_graph(type_only=True))
    assert not found, "import cycles through TYPE_CHECKING imports:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_what_it_must():
    """The checker itself: a lazy import inside a function counts, a TYPE_CHECKING import does not,
    ``from pkg import sub`` names the submodule, and a two-module circle is found."""
    modules = {"engine.a": Path("a.py"), "engine.b": Path("b.py"), "agentrt.x": Path("x.py"),
               "engine": Path("__init__.py")}
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine import b\n"
           "def f():\n    from agentrt.x import thing\n")
    tree_path = ROOT / "out" / "layers_probe.py"
    tree_path.parent.mkdir(exist_ok=True)
    tree_path.write_text(src)
    try:
        assert imports_of("engine.a", tree_path, modules) == {"agentrt.x"}
        assert imports_of("engine.a", tree_path, modules, type_only=True) == {"agentrt.x", "engine.b"}
    finally:
        tree_path.unlink()
    assert forbidden("engine.a", "agentrt.x") and forbidden("agentrt.server", "router.core")
    assert forbidden("router.core", "benchmarks.workload") and not forbidden("agentrt_cli", "router.commands")
    assert forbidden("agentrt.cli", "router.commands") and forbidden("router.commands", "agentrt_cli")
    assert not forbidden("router.core", "agentrt.core.errors")
    assert forbidden("router.worker_api", "agentrt.core.turns") and forbidden("router.app", "agentrt.api.openai")
    assert forbidden("agentrt.core.turns", "agentrt.api.openai") and forbidden("agentrt.core.generation", "agentrt.server")
    assert forbidden("agentrt.api.responses", "agentrt.api.openai")
    assert not forbidden("agentrt.api.responses", "agentrt.api.responses_output")
    assert not forbidden("agentrt.api.messages", "agentrt.core.generation")
    assert not forbidden("agentrt.api.sessions", "agentrt.api.http") and forbidden("agentrt.api.http", "agentrt.api.openai")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.slow
def test_a_router_loads_its_model_side_without_torch():
    """A router reads only the tokenizer side of the model (engine/loader/tokenizer_files.py): importing torch
    was over half of its start (1 of 1.8 CPU-s). Its app is built (Redis is reached only when it starts) in a fresh
    interpreter, and torch is not in it."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from agentrt.config import RouterServerConfig\n"
            "from router.app import create_router_app\n"
            "from router.config import RouterConfig\n"
            "app = create_router_app(RouterServerConfig(), RouterConfig(redis_url='redis://127.0.0.1:1/0'))\n"
            "assert app.state.core.model_id == 'SmolLM2-135M-Instruct', app.state.core.model_id\n"
            "print(sorted(n for n in ('torch', 'safetensors') if n in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
