"""scripts/mutation_check.py: a mutation is applied exactly where named and always reverted.

The mutation runs themselves are on demand (minutes); these tests check the apply/revert logic and
that every registered mutation still finds its text, so the list cannot rot silently.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
mc = importlib.util.module_from_spec(_spec)
sys.modules["mutation_check"] = mc  # dataclasses look their module up there
_spec.loader.exec_module(mc)


def _tree(tmp_path: Path, text: str) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(text)
    return tmp_path


def test_apply_writes_the_new_text_and_revert_restores_the_file(tmp_path):
    root = _tree(tmp_path, "def f(x):\n    return x > 0\n")
    m = mc.Mutation("flip", "pkg/mod.py", "x > 0", "x >= 0", ("t",))
    original = mc.apply(root, m)
    assert (root / "pkg/mod.py").read_text() == "def f(x):\n    return x >= 0\n"
    mc.revert(root, m, original)
    assert (root / "pkg/mod.py").read_text() == "def f(x):\n    return x > 0\n"


@pytest.mark.parametrize(("text", "count"), [("return y\n", 0), ("x > 0\nx > 0\n", 2)])
def test_apply_refuses_text_that_is_not_there_exactly_once(tmp_path, text, count):
    root = _tree(tmp_path, text)
    m = mc.Mutation("flip", "pkg/mod.py", "x > 0", "x >= 0", ("t",))
    with pytest.raises(ValueError, match=f"'flip'.*pkg/mod.py holds its old text {count} times"):
        mc.apply(root, m)
    assert (root / "pkg/mod.py").read_text() == text


def test_check_reports_caught_and_missed_and_reverts_each_file(tmp_path, monkeypatch):
    """A real pytest run in a small tree: the test catches one mutation and not the other."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the tiny tree needs no plugin: start fast
    root = _tree(tmp_path, "def positive(x):\n    return x > 0\n\n\ndef half(x):\n    return x / 2\n")
    (root / "test_mod.py").write_text("from pkg.mod import positive\n\n\ndef test_zero():\n"
                                      "    assert positive(0) is False\n")
    (root / "pkg" / "__init__.py").write_text("")
    before = (root / "pkg/mod.py").read_text()
    caught = mc.Mutation("zero-positive", "pkg/mod.py", "x > 0", "x >= 0", ("test_mod.py",))
    missed = mc.Mutation("half-untested", "pkg/mod.py", "x / 2", "x / 3", ("test_mod.py",))
    records = mc.check(root, [caught, missed], timeout=120)
    assert [(r["name"], r["status"]) for r in records] == [("zero-positive", "caught"), ("half-untested", "missed")]
    assert (root / "pkg/mod.py").read_text() == before


def test_every_registered_mutation_finds_its_text_once_and_names_existing_tests():
    names = [m.name for m in mc.MUTATIONS]
    assert len(names) == len(set(names))
    for m in mc.MUTATIONS:
        assert (ROOT / m.file).read_text().count(m.old) == 1, m.name
        assert m.old != m.new and m.tests, m.name
        assert all((ROOT / t.split("::")[0]).is_file() for t in m.tests), m.name


def test_only_refuses_an_unknown_mutation_name():
    done = subprocess.run([sys.executable, str(ROOT / "scripts/mutation_check.py"), "--only", "nope", "--list"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown mutation(s) ['nope']" in done.stderr
    listed = subprocess.run([sys.executable, str(ROOT / "scripts/mutation_check.py"), "--list"],
                            capture_output=True, text=True, check=True).stdout
    assert [line.split(":")[0] for line in listed.splitlines()] == [m.name for m in mc.MUTATIONS]
