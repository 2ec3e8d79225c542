"""Give results JSONs recorded before `benchmarks/harness.py` an honest header.

    python scripts/retrofit_headers.py [FILE.json ...]   # default: every benchmarks/results/*.json

The harness writes a "header" (schema agentrt-bench/1: commit, dirty tree, machine, torch,
kernels, ...) into every result. Results recorded before it carry some of that and not the rest.
This script adds a header that copies only what the JSON itself recorded, and says "unknown"
for the rest, with "retrofitted": true (tests/test_docs_figures.py accepts "unknown" only in
such a header). A file that already has a header is left alone. Nothing is inferred from the
repository's history or the file's name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SCHEMA = "agentrt-bench/1"
NOTE = "recorded before benchmarks/harness.py; fields it did not record are unknown"
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _recorded_commit(result: dict[str, Any]) -> str:
    """The commit the result names: vs_llamacpp's settings.head_commit, router_events_ab's rev."""
    settings = result.get("agentrt", {}).get("settings", {}) if isinstance(result.get("agentrt"), dict) else {}
    for value in (settings.get("head_commit"), result.get("rev"), result.get("commit")):
        if isinstance(value, str) and value:
            return value
    return "unknown"


def _recorded_machine(result: dict[str, Any]) -> Any:
    """What the result says about the machine: its "machine" record, else the fields it kept."""
    machine = result.get("machine")
    if isinstance(machine, dict):
        return machine
    config = result.get("config")
    fields = {}
    if isinstance(machine, str):
        fields["machine"] = machine
    if isinstance(config, dict) and isinstance(config.get("machine"), str):
        fields["machine"] = config["machine"]
    for key in ("cpus", "device"):
        if isinstance(result.get(key), (int, str)):
            fields[key] = result[key]
    return fields or "unknown"


def _recorded_torch(result: dict[str, Any]) -> Any:
    """torch's version and threads where the result kept them (gpu_check: version; machine.torch_threads)."""
    version = result.get("torch") if isinstance(result.get("torch"), str) else None
    machine = result.get("machine") if isinstance(result.get("machine"), dict) else {}
    threads = machine.get("torch_threads")
    if version is None and threads is None:
        return "unknown"
    return {"version": version or "unknown", "threads": threads if threads is not None else "unknown"}


def retrofit_header(result: dict[str, Any]) -> dict[str, Any]:
    """The header for a result recorded before the harness: recorded values or "unknown"."""
    settings = result.get("agentrt", {}).get("settings", {}) if isinstance(result.get("agentrt"), dict) else {}
    kernels = settings.get("cpu_kernels", result.get("kernels", "unknown"))
    return {
        "schema": SCHEMA,
        "retrofitted": True,
        "commit": _recorded_commit(result),
        "dirty": "unknown",
        "machine": _recorded_machine(result),
        "torch": _recorded_torch(result),
        "kernels": kernels,
        "command": result.get("command", "unknown"),
        "note": NOTE,
    }


def _indent_of(text: str) -> int | None:
    """The indent the file was written with (so the diff is the header alone)."""
    lines = text.splitlines()
    if len(lines) < 2:
        return None
    second = lines[1]
    return len(second) - len(second.lstrip(" "))


def retrofit_file(path: Path) -> bool:
    """Add a retrofitted header to `path` unless it has one; True when the file was changed."""
    text = path.read_text()
    result = json.loads(text)
    if not isinstance(result, dict):
        raise ValueError(f"{path}: a results JSON must be an object, got {type(result).__name__}")
    if "header" in result:
        return False
    updated = {"header": retrofit_header(result), **result}
    path.write_text(json.dumps(updated, indent=_indent_of(text)) + "\n")
    return True


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted(RESULTS.glob("*.json"))
    for path in paths:
        print(f"{'retrofitted' if retrofit_file(path) else 'has a header'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
