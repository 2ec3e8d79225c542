"""benchmarks/packed_linear.py's flags: an empty workload or row list is refused before anything is built."""

from __future__ import annotations

import pytest

from benchmarks import packed_linear


@pytest.mark.parametrize("argv,message", [
    (["--engine", "--sessions", "0"], "--sessions and --turns must be >= 1"),
    (["--engine", "--turns", "-1"], "--sessions and --turns must be >= 1"),
    (["--rows", "0,4"], "--rows, --layers, --threads and --calls must be >= 1"),
    (["--rows", "one"], "--rows: comma-separated integers"),
])
def test_bad_flags_are_refused_with_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        packed_linear.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
