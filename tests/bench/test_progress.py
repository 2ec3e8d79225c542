"""Progress bars: drawn on stderr only when it is a terminal, never on stdout; the model loader's
bar only for large files, counting bytes."""

from __future__ import annotations

import io
import sys

from agentrt.bench.progress import bar, note
from engine.loader.gguf_loader import default_model_path
from engine.loader.progress import load_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def streams(monkeypatch) -> tuple[Terminal, io.StringIO]:
    """A terminal as stderr and a plain buffer as stdout (set in the test body: pytest's own capture
    replaces them again after fixtures are set up)."""
    err, out = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    return err, out


def test_bench_bar_on_a_terminal_only(monkeypatch):
    err, out = streams(monkeypatch)
    with bar(4, "bench", unit="call") as b:
        b.update(3)
    assert "bench" in err.getvalue() and "3/4" in err.getvalue() and out.getvalue() == ""
    err.truncate(0)
    with bar(4, "bench", enabled=False) as b:  # --no-progress
        b.update(4)
    assert err.getvalue() == ""
    piped = io.StringIO()  # not a TTY: quiet
    monkeypatch.setattr(sys, "stderr", piped)
    with bar(4, "bench") as b:
        b.update(4)
    assert piped.getvalue() == ""
    note("planned: 1 sessions")
    assert piped.getvalue() == "planned: 1 sessions\n" and out.getvalue() == ""


def test_loader_bar_only_for_large_files(monkeypatch):
    err, _ = streams(monkeypatch)
    path = default_model_path()
    assert load_bar([path], "x").disable  # ~100 MB: under the threshold, no bar
    with load_bar([path], "loading model", threshold_bytes=1) as b:
        b.update(1024 * 1024)
        assert b.n == 1024 * 1024 and b.total > 90 * 1024 * 1024
    assert "loading model" in err.getvalue()
