"""benchmarks/harness.py: the ABBA order, per-run figures with median and range, the flags parser,
the commit / dirty-tree detection on a throwaway git repository, and the header's keys."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess

import pytest

from benchmarks import harness


def test_ab_order_alternates_abba_and_fixed_keeps_order():
    seq = harness.ab_order(["A", "B"], 4, "alternate")
    assert [s for _, s in seq] == list("ABBAABBA")
    assert [r for r, _ in seq] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s for _, s in harness.ab_order(["A", "B"], 3, "fixed")] == list("ABABAB")
    assert [s for _, s in harness.ab_order(["x", "y", "z"], 2, "alternate")] == list("xyzzyx")
    with pytest.raises(ValueError, match="order must be one of"):
        harness.ab_order(["A"], 1, "random")
    with pytest.raises(ValueError, match="repeats >= 1"):
        harness.ab_order(["A", "B"], 0, "fixed")


def test_spread_keeps_runs_and_ignores_missing():
    s = harness.spread([3.0, None, 1.0, 2.0, 10.0])
    assert s == {"runs": [3.0, None, 1.0, 2.0, 10.0], "median": 2.5, "min": 1.0, "max": 10.0}
    assert harness.spread([None]) == {"runs": [None], "median": None, "min": None, "max": None}


def test_common_flags_refuse_bad_values_and_have_help():
    p = argparse.ArgumentParser()
    harness.add_common_args(p, repeats=3)
    a = p.parse_args([])
    assert (a.json, a.repeats, a.order) == (None, 3, "alternate")
    with pytest.raises(SystemExit):
        p.parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit):
        p.parse_args(["--order", "random"])
    assert all(action.help for action in p._actions)


def test_non_default_flags():
    flags = ["--port", "8000", "--dtype", "float32", "--no-repack", "-np", "4", "--kv-cache-tokens=9000"]
    assert harness.non_default_flags(flags) == {"--dtype": "float32", "--no-repack": True, "-np": "4",
                                                "--kv-cache-tokens": "9000"}


def git(repo, *cmd):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *cmd], cwd=repo, check=True,
                   capture_output=True)


def test_git_state_sees_commit_dirty_tree_and_diff(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "commit", "-qm", "first")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert harness.git_state(tmp_path) == {"commit": head, "dirty": False, "diff_sha256": None}
    (tmp_path / "a.txt").write_text("two\n")
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=tmp_path, capture_output=True).stdout
    state = harness.git_state(tmp_path)
    assert state["dirty"] and state["diff_sha256"] == hashlib.sha256(diff).hexdigest()
    git(tmp_path, "checkout", "-q", "a.txt")
    (tmp_path / "new.py").write_text("x = 1\n")                 # untracked only: dirty, empty diff
    assert harness.git_state(tmp_path)["dirty"] is True
    assert len(head) == 40


def test_header_has_exactly_the_documented_keys(tmp_path):
    args = argparse.Namespace(json=tmp_path / "out" / "r.json", repeats=2, order="alternate")
    run = harness.Run(args, "benchmarks/speculative.py", argv=["--quick"])
    run.add_server("agentrt", ["python", "-m", "agentrt_cli", "serve", "--port", "1", "--dtype", "float32"],
                   harness.non_default_flags(["--port", "1", "--dtype", "float32"]))
    result = run.write({"figures": {"x": 1}}, kernels={"decode_attention": True, "layer_ops": False})
    on_disk = json.loads(args.json.read_text())
    assert on_disk == result and on_disk["figures"] == {"x": 1}
    h = on_disk["header"]
    assert tuple(h) == harness.HEADER_KEYS + harness.HEADER_ADDED
    assert set(h["loadavg"]) == {"start", "end"} and len(h["loadavg"]["end"]) == 3
    assert h["schema"] == "agentrt-bench/1" and h["script"] == "benchmarks/speculative.py"
    assert h["argv"] == ["--quick"] and (h["order"], h["repeats"]) == ("alternate", 2)
    assert len(h["commit"]) == 40 and isinstance(h["dirty"], bool)
    assert (h["diff_sha256"] is None) == (not h["dirty"])
    assert set(h["machine"]) == {"cpu_model", "cores_usable", "memory_gib", "cpu_flags"}
    assert h["machine"]["cores_usable"] >= 1
    assert set(h["torch"]) == {"version", "threads"} and set(h["env"]) == set(harness.ENV_RECORDED) >= {"OMP_NUM_THREADS", "AGENTRT_KERNEL_MARCH"}
    assert h["kernels"] == {"decode_attention": True, "layer_ops": False} and h["engine"] is None
    assert h["servers"] == [{"name": "agentrt", "cmd": ["python", "-m", "agentrt_cli", "serve", "--port", "1",
                                                        "--dtype", "float32"],
                             "non_default_flags": {"--dtype": "float32"}}]


def test_serve_settings_follow_the_flags():
    assert harness.serve_settings(["--dtype", "float32", "--speculative", "off"])["dtype"] == "float32"
    s = harness.serve_settings(["--dtype", "float32", "--speculative", "off"])
    assert (s["speculative"], s["quantization"]) == ("off", "off")   # int4 runs only in bf16


def test_every_benchmark_flag_has_help_and_every_script_uses_the_harness():
    """Read from the sources: each ``add_argument`` call in benchmarks/ passes ``help=``, and every
    script with a ``--json`` goes through the harness (no json writing or git lookups of its own)."""
    import ast

    missing, own_writers = [], []
    for path in sorted(harness.REPO.glob("benchmarks/*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                if not any(k.arg == "help" for k in node.keywords):
                    flag = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else "?"
                    missing.append(f"{path.name}: {flag}")
        text = path.read_text()
        if path.name != "harness.py" and ("json.dump(" in text or "rev-parse" in text or "/proc/cpuinfo\")" in text
                                          or "agentrt.bench.report import write_json" in text):
            own_writers.append(path.name)   # agentrt.bench's writer puts no header on the results
    assert missing == []
    assert own_writers == []
