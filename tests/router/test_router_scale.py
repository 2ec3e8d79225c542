"""benchmarks/router_scale.py on a tiny fleet: the JSON shape, the fleet it claims to build,
and the same decisions on the bitset index and on the reference dict of sets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import router_scale  # noqa: E402

ARGS = ["--workers", "2,6", "--blocks-per-worker", "1200", "--decisions", "40", "--churn-events", "40",
        "--churn-blocks", "3000", "--tokenize", "0"]


@pytest.mark.slow
def test_tiny_fleet_json_and_reference_agree(tmp_path):
    runs = {}
    for index in ("bitset", "reference"):
        out = tmp_path / f"{index}.json"
        assert router_scale.main(ARGS + ["--index", index, "--json", str(out)]) == 0
        runs[index] = json.loads(out.read_text())["runs"]
    bitset, reference = runs["bitset"], runs["reference"]
    assert [r["workers"] for r in bitset] == [2, 6]
    for r, ref in zip(bitset, reference):
        assert {"workers", "blocks_per_worker", "decision_p50_ms", "decision_p99_ms", "bytes_per_block",
                "events_per_s", "events_per_s_1block", "events_per_s_1block_reference",
                "events_per_s_1block_speedup", "events_per_s_reference", "gc_full_ms", "gc_full_frozen_ms"} <= set(r)
        assert r["gc_full_ms"] > 0 and r["gc_full_frozen_ms"] >= 0
        assert r["pairs"] == r["workers"] * 1200 and r["resync_blocks"] == 1200
        assert 0.3 <= r["shared_pair_fraction"] <= 0.6  # about half the pairs are common prefixes
        assert r["distinct_blocks"] < r["pairs"]
        assert 0 < r["decision_p50_ms"] <= r["decision_p99_ms"] and r["bytes_per_block"] > 0
        assert sum(r["decision_reasons"].values()) == 40
        # Same seed, same fleet, same events: both indexes must lead the policy to the same choices.
        for key in ("pairs", "distinct_blocks", "shared_pair_fraction", "decision_reasons", "hashes_per_event"):
            assert r[key] == ref[key], key


def test_bad_arguments_are_refused(capsys):
    for bad in (["--workers", "8,x"], ["--workers", "0"], ["--blocks-per-worker", "10"],
                ["--shared-fraction", "1.5"]):
        try:
            router_scale.main(bad)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{bad} accepted")
    assert "--workers takes comma-separated integers" in capsys.readouterr().err


def test_events_ab_against_a_revision(tmp_path):
    """benchmarks/router_events_ab.py on a tiny fleet against HEAD: it runs, and both stacks agree."""
    import router_events_ab

    out = tmp_path / "ab.json"
    assert router_events_ab.main(["--rev", "HEAD", "--workers", "2", "--blocks-per-worker", "600", "--rounds", "2",
                                  "--events-per-round", "20", "--blocks-per-round", "2000", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["rev"] == "HEAD" and {"rev", "tree", "speedup"} <= set(got["1block"]) and got["trace"]["tree"]["events_per_s"] > 0
