"""Plant known bugs one at a time and check that the named tests catch each (on demand, not in `make test`).

    python scripts/mutation_check.py [--only NAME ...] [--list] [--json OUT] [--timeout S]

Each mutation names a file, an exact text that must occur in it exactly once, the text that replaces
it, and the tests expected to fail. The script copies the repository (tracked and untracked,
not-ignored files) to a temporary directory once, runs the named tests there unmutated (they must
pass, or nothing is reported), then for each mutation: writes it, runs its tests, and restores the
file (in a `finally`, checked byte for byte). The working tree is never written. It prints, and with
`--json` writes, one record per mutation: "caught" (pytest exit 1: tests failed), "missed" (exit 0),
"error" (another exit: collection or usage error, with the output's tail) or "timeout".
The docs quote the planted-bug counts this script reports, not a count made by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLEET_TESTS = ("tests/router/test_fleet_policy.py",)
CORE_TESTS = ("tests/router/test_router_core_fleet.py",)


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur in the file exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids expected to fail with the mutation in place


MUTATIONS = [
    Mutation("walk-stops-at-a-cost-tie", "router/policies/agentrt.py",
             "if win is not None and key[0] > win[0]:", "if win is not None and key[0] >= win[0]:", FLEET_TESTS),
    Mutation("mean-load-off-by-one", "router/policies/agentrt.py",
             "mean = fleet.load_sum() / size", "mean = fleet.load_sum() / (size + 1)", FLEET_TESTS),
    Mutation("spill-named-prefix", "router/policies/agentrt.py",
             'reason = "spill" if spilled else ("prefix" if c == best else "cost")',
             'reason = "prefix" if spilled else ("prefix" if c == best else "cost")', FLEET_TESTS),
    Mutation("unmatched-group-empty", "router/policies/agentrt.py",
             "return lambda wid: matched.get(wid, 0) <= 0", "return lambda wid: matched.get(wid, 0) < 0",
             FLEET_TESTS),
    Mutation("forgotten-worker-stays-in-the-fleet", "router/core.py",
             "        self.loads.pop(worker_id, None)\n        self._sync_worker(worker_id)\n",
             "        self.loads.pop(worker_id, None)\n", CORE_TESTS),
    Mutation("refresh-keeps-departed-workers", "router/core.py",
             "for wid in [wid for wid in self.fleet if wid not in self.workers]:",
             "for wid in [wid for wid in self.fleet if wid not in self.workers and False]:", CORE_TESTS),
]


def apply(root: Path, mutation: Mutation) -> str:
    """Write the mutation into `root`; returns the file's original text (for `revert`)."""
    path = root / mutation.file
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise ValueError(f"mutation {mutation.name!r}: {mutation.file} holds its old text {count} times "
                         f"(need exactly 1): {mutation.old!r}")
    path.write_text(text.replace(mutation.old, mutation.new))
    return text


def revert(root: Path, mutation: Mutation, original: str) -> None:
    """Put the file back and check it is byte for byte what it was."""
    path = root / mutation.file
    path.write_text(original)
    if path.read_text() != original:
        raise RuntimeError(f"mutation {mutation.name!r}: {mutation.file} was not restored")


def copy_repo(src: Path, dst: Path) -> None:
    """Copy the files git would carry (tracked, and untracked ones it does not ignore) to `dst`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=src, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (src / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dst / rel)


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """(status, seconds, output tail) of pytest over `tests` in `root`, stopping at the first failure."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    status = {0: "missed", 1: "caught"}.get(done.returncode, "error")
    return status, time.monotonic() - start, (done.stdout + done.stderr)[-2000:]


def check(root: Path, mutations: list[Mutation], timeout: float) -> list[dict]:
    """Each mutation applied alone in `root`, its tests run, the file restored."""
    records = []
    for mutation in mutations:
        original = apply(root, mutation)
        try:
            status, seconds, tail = run_tests(root, mutation.tests, timeout)
        finally:
            revert(root, mutation, original)
        record = {**asdict(mutation), "status": status, "seconds": round(seconds, 1)}
        if status == "error":
            record["output_tail"] = tail
        records.append(record)
        print(f"{status:8s} {mutation.name} ({seconds:.1f} s)", file=sys.stderr)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per test run (default 300)")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    unknown = sorted(set(args.only or ()) - set(by_name))
    if unknown:
        parser.error(f"--only: unknown mutation(s) {unknown}; known: {sorted(by_name)}")
    chosen = [by_name[n] for n in args.only] if args.only else MUTATIONS
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file} -> {' '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        root = Path(tmp)
        copy_repo(ROOT, root)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        status, _, tail = run_tests(root, tests, args.timeout)
        if status != "missed":  # unmutated, every test must pass
            print(f"the unmutated tests did not pass ({status}):\n{tail}", file=sys.stderr)
            return 2
        records = check(root, chosen, args.timeout)
    report = {"mutations": records, "caught": sum(r["status"] == "caught" for r in records),
              "total": len(records)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report["caught"] == report["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
