"""Expert parallelism in real processes (gloo): output equals the dense oracle for every
placement and family, on 2 ranks (one node) and 4 ranks (2 nodes x 2), also after a
weight migration; counted traffic equals the simulated dispatch."""

from __future__ import annotations

import pytest

from benchmarks.moe_checkpoint import write_tiny_checkpoint
from benchmarks.moe_launch import run_distributed
from benchmarks.moe_selfcheck import ep_matches_reference
from engine.moe.config import Topology

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
PLACEMENTS = ["contiguous", "balanced", "locality"]


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ep")
    return [str(write_tiny_checkpoint(root / f, f, seed=11)) for f in FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize("topology", [Topology(1, 2), Topology(2, 2)], ids=["2ranks", "4ranks_2x2"])
def test_ep_equals_dense_reference(topology, checkpoint_dirs):
    results = run_distributed(ep_matches_reference, topology, checkpoint_dirs, PLACEMENTS, topology.world_size,
                              fn_kwargs={"placement_kwargs": {"locality": {"max_evals": 200}}})
    expected = {f"{f}/{p}{suffix}" for f in FAMILIES for p in PLACEMENTS for suffix in ("", "/migrated", "/traffic_mismatch")}
    for rank, res in enumerate(results):
        assert set(res) == expected
        for key, value in res.items():
            if key.endswith("traffic_mismatch"):
                assert value == 0, (rank, key)
            else:
                assert value <= 1e-5, (rank, key, value)
