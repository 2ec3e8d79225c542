"""Sizes the house keeps (#32): no function or method of the installed packages runs past
``MAX_FUNCTION_LINES`` lines (from its ``def`` to its last line, docstring included), and the engine's
class (``engine/engine.py``'s ``LLMEngine``) stays within ``MAX_ENGINE_LINES``. A function that grows
past the line is split where its parts have names of their own, not squeezed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "agentrt", "router", "agentrt_cli")
MAX_FUNCTION_LINES = 60
MAX_ENGINE_LINES = 200


def long_functions(source: str, name: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name:line function (n lines)`` for each function or method in ``source`` longer than ``limit``."""
    return [f"{name}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_of_the_packages_is_over_the_line():
    files = [f for p in PACKAGES for f in sorted((ROOT / p).rglob("*.py"))]
    assert len(files) > 100, files   # the walk found the packages
    bad = [x for f in files for x in long_functions(f.read_text(), str(f.relative_to(ROOT)))]
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(bad)


def test_the_engine_class_fits_its_budget():
    tree = ast.parse((ROOT / "engine" / "engine.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine"]
    lines = cls.end_lineno - cls.lineno + 1
    assert 50 < lines <= MAX_ENGINE_LINES, lines


def test_the_checker_counts_from_def_to_the_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(58))
    fits = f'def f():\n    """doc"""\n{body}\n'                                   # 60 lines
    method = body.replace("    ", "        ")
    over = f'class C:\n    async def g(self):\n        """doc"""\n{method}\n        return 1\n'   # 61 lines
    assert long_functions(fits, "a.py") == []
    assert long_functions(over, "b.py") == ["b.py:2 g (61 lines)"]
