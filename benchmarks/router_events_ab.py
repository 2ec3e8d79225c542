"""The KV event path of a git revision against the working tree's, in one process, on the same events.

    python benchmarks/router_events_ab.py --rev 3819833 --workers 128 --blocks-per-worker 100000 --json out/ab.json

``router_scale.py`` times ``apply_entries`` against ``apply_entries_reference`` on one index; both
share the working tree's index and tentative code. This compares two whole stacks instead: the
revision's ``router/events.py``, ``router/index.py``, ``router/tentative.py`` and
``router/event_consumer.py`` (read with ``git show`` and loaded under other module names) and the
working tree's, each with its own ``PrefixIndex`` and ``TentativeIndex.confirmed`` as ``on_blocks``.
The revision's consumer is driven the way its ``poll`` handled a batch (per entry: the id decoded,
then ``_handle``), unless it has ``apply_entries``. The same fleet (``router_scale.build_fleet``) is
built into both, then the same churn streams go through both in alternating rounds (the order
swapped every round). Both indexes and all seqs must end identical. Rates are medians over rounds;
the speedup is the median of the per-round ratios (ratios on a machine shared with other jobs, not
figures to compare across runs).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import redis.asyncio as aioredis  # noqa: E402

import router_scale as rs  # noqa: E402
from benchmarks import harness  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.event_consumer import KVEventConsumer, Snapshot  # noqa: E402
from router.index import PrefixIndex  # noqa: E402
from router.tentative import TentativeIndex  # noqa: E402


def load_revision(rev: str, tmp: Path) -> dict:
    """The revision's event modules, imported as ``rev_events`` etc. (their imports of each other rewired)."""
    subs = [("from router.events import", "from rev_events import"), ("from router.index import", "from rev_index import")]
    mods = {}
    for name in ("events", "index", "tentative", "event_consumer"):
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:router/{name}.py"], capture_output=True,
                             text=True, check=True).stdout
        for a, b in subs:
            src = src.replace(a, b)
        path = tmp / f"rev_{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"rev_{name}", path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[f"rev_{name}"] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        mods[name] = module
    return mods


def poll_body(consumer):
    """What ``poll`` does with the batches it reads, for this consumer's code."""
    if hasattr(consumer, "apply_entries"):
        async def run(batches):
            for entries in batches:
                await consumer.apply_entries(entries)
    else:
        async def run(batches):
            for entries in batches:
                for entry_id, fields in entries:
                    consumer._last_id = consumer.stats.last_id = entry_id.decode()
                    await consumer._handle(fields.get(b"e"))
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="git revision to compare the working tree with")
    p.add_argument("--workers", type=int, default=128, help="workers in the synthetic fleet")
    p.add_argument("--blocks-per-worker", type=int, default=100_000, help="KV blocks each worker holds at start")
    p.add_argument("--rounds", type=int, default=10, help="one-block rounds (trace-size: half as many)")
    p.add_argument("--events-per-round", type=int, default=10_000, help="one-block events per round")
    p.add_argument("--blocks-per-round", type=int, default=300_000, help="trace-size rounds")
    p.add_argument("--seed", type=int, default=0, help="seed of the fleet and the churn")
    harness.add_common_args(p, repeats=None)
    args = p.parse_args(argv)
    run_info = harness.Run(args, __file__, argv)
    with tempfile.TemporaryDirectory() as tmp:
        rev = load_revision(args.rev, Path(tmp))
    cfg = RouterConfig()
    rng = random.Random(args.seed)
    heads, weights, new_blocks = rs.common_prefixes(rs.load_records(rs.DEFAULT_TRACE))
    fleet = rs.build_fleet(args.workers, args.blocks_per_worker, 0.5, rng, heads, weights, new_blocks,
                           rs.SharedChains())
    payloads = rs.interleave(fleet)
    for w in fleet:
        w.n_events, w.events, w.blocks = len(w.events), [], set()
    gc.collect()
    gc.freeze()

    async def snapshot(wid: str) -> Snapshot:
        return Snapshot(-1, ())

    stacks = {
        "rev": rev["event_consumer"].KVEventConsumer(
            None, cfg, rev["index"].PrefixIndex(), snapshot_source=snapshot,
            on_blocks=rev["tentative"].TentativeIndex(aioredis.Redis(), cfg).confirmed),
        "tree": KVEventConsumer(None, cfg, PrefixIndex(), snapshot_source=snapshot,  # type: ignore[arg-type]
                                on_blocks=TentativeIndex(aioredis.Redis(), cfg).confirmed),
    }
    runs = {name: poll_body(c) for name, c in stacks.items()}
    batches = rs.stream_batches(payloads, 1000)
    del payloads
    for run in runs.values():
        asyncio.run(run(batches))
    del batches
    seqs = {w.worker_id: w.n_events for w in fleet}
    out: dict = {"rev": args.rev, "workers": args.workers, "blocks_per_worker": args.blocks_per_worker,
                 "rounds": args.rounds, "events_per_round": args.events_per_round,
                 "blocks_per_round": args.blocks_per_round, "order": "rev first on even rounds, tree first on odd",
                 "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    for label, one, n_events, n_blocks, rounds in (
            ("1block", True, args.events_per_round, 0, args.rounds),
            ("trace", False, 2, args.blocks_per_round, max(2, args.rounds // 2))):
        rates: dict[str, list[tuple[float, float]]] = {"rev": [], "tree": []}
        for r in range(rounds):
            stream, _ = rs.churn(fleet, seqs, n_events, n_blocks, rng, one)
            for name in ("rev", "tree") if r % 2 == 0 else ("tree", "rev"):
                gc.collect()
                b = rs.stream_batches(stream, 1000)
                c0, t0 = time.process_time(), time.perf_counter()
                asyncio.run(runs[name](b))
                rates[name].append((len(stream) / (time.perf_counter() - t0), len(stream) / (time.process_time() - c0)))
        out[label] = {name: {"events_per_s": round(statistics.median(x[0] for x in v)),
                             "events_per_cpu_s": round(statistics.median(x[1] for x in v))} for name, v in rates.items()}
        out[label]["speedup"] = round(statistics.median(t[0] / r_[0] for r_, t in zip(rates["rev"], rates["tree"])), 2)
        print(label, json.dumps(out[label]), flush=True)
    a, b = stacks["rev"], stacks["tree"]
    if a.index._holders != b.index._holders or a._next_seq != b._next_seq or a.stats.applied != b.stats.applied:
        raise RuntimeError("the two stacks disagree after the same events")
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    run_info.write(out, kernels={})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
