"""A bench result as JSON, a Markdown report and PNG plots (latency CDFs, throughput vs load, hit rate).

Plots need matplotlib (a dependency of agentrt); they are written beside the Markdown file
as ``<stem>-latency.png``, ``<stem>-load.png`` (only for a rate sweep) and ``<stem>-hits.png``.
"""

from __future__ import annotations

import json
from pathlib import Path


def fmt(value, digits: int = 3, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}{unit}" if abs(value) < 1000 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


def write_json(result: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def run_table(runs: list[dict]) -> list[str]:
    rows = ["| rate (sessions/s) | calls ok/all | TTFT p50/p90/p99 s | TPOT p50/p90/p99 s | E2E p50/p99 s | "
            "JCT p50/p99 s | out tok/s (per worker) | total tok/s | prompt tok (cached) | hit rate | goodput req/s | "
            "attainment | worker-h/M out | $/M out | $/M total |", "|" + "---|" * 15]
    for r in runs:
        s = r["summary"]
        t, p, e, j = s["ttft_s"], s["tpot_s"], s["e2e_s"], s["jct_s"]
        cost = s.get("cost") or {}
        rows.append(
            f"| {fmt(r['rate'])} | {s['calls_ok']}/{s['calls']} | {fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} | "
            f"{fmt(p['p50'])} / {fmt(p['p90'])} / {fmt(p['p99'])} | {fmt(e['p50'])} / {fmt(e['p99'])} | "
            f"{fmt(j['p50'])} / {fmt(j['p99'])} | {fmt(s['output_tok_s'])} ({fmt(s['output_tok_s_per_worker'])}) | "
            f"{fmt(s['total_tok_s'])} | {fmt(s['prompt_tokens'])} ({fmt(s['cached_tokens'])}) | {fmt(s['hit_rate'])} | "
            f"{fmt(s['goodput_rps'])} | {fmt(s['attainment'])} | {fmt(cost.get('worker_hours_per_million_output_tokens'))} | "
            f"{fmt(cost.get('per_million_output_tokens'))} | {fmt(cost.get('per_million_total_tokens'))} |")
    return rows


def bounded_lines(runs: list[dict]) -> list[str]:
    """One line per run bounded by ``--duration``: what ran, and that the figures cover only that."""
    out = []
    for r in runs:
        b = r.get("bounded") or {}
        if b.get("duration_s") is None:
            continue
        how = "stopped early" if b["stopped_early"] else "finished within it"
        out.append(f"bounded run (rate {fmt(r['rate'])}): --duration {b['duration_s']:g} s (grace {b['grace_s']:g} s), "
                   f"{how}: {b['sessions_started']}/{b['sessions_planned']} sessions started, "
                   f"{b['sessions_completed']} completed; {b['turns_completed']}/{b['turns_planned']} turns completed, "
                   f"{b['turns_cut']} cut at the hard limit, {b['turns_not_started']} not started"
                   + ("; the figures cover the completed turns only" if b["stopped_early"] else ""))
    return out


def server_table(runs: list[dict]) -> list[str]:
    rows = ["| rate | server | requests | prompt tokens | cached tokens | completion tokens |", "|---|---|---|---|---|---|"]
    for r in runs:
        for url, d in (r.get("server_metrics") or {}).items():
            if d is None:
                rows.append(f"| {fmt(r['rate'])} | {url} | no /metrics | | | |")
                continue
            cells = " | ".join(fmt(None if d.get(k) is None else int(d[k]))
                               for k in ("requests_ok", "prompt_tokens", "cached_tokens", "completion_tokens"))
            rows.append(f"| {fmt(r['rate'])} | {url} | {cells} |")
    return rows


def markdown(result: dict, title: str, plots: dict[str, str], command: str | None = None) -> str:
    o, m = result["options"], result["machine"]
    slo = o["slo"]
    lines = [f"# {title}", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    workload = f"trace `{o['trace']}`" if o.get("trace") else f"preset `{o['preset']}`"
    lines += [f"Target {o['target']} ({o['api']} API), {workload}, {o['sessions']} sessions, seed {o['seed']}, "
              f"model `{result['runs'][0]['model']}`.",
              f"Machine: {m['processor']}, {m['cpus']} CPUs, {m['platform']}"
              + (f", GPU {m['cuda']}" if m.get("cuda") else ", no GPU (CPU figures)") + ".",
              f"SLO: TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s']} s; a rate meets it when "
              f">= {slo['attainment']:.0%} of calls do.", ""]
    if o.get("price_per_worker_hour") is not None:
        lines += [f"Cost at ${o['price_per_worker_hour']}/worker-hour x {o['workers']} workers.", ""]
    lines += run_table(result["runs"]) + [""]
    if bounded_lines(result["runs"]):
        lines += bounded_lines(result["runs"]) + [""]
    if result.get("best_rate") is not None or o.get("rates"):
        lines += [f"Highest rate meeting the SLO: {fmt(result.get('best_rate'))} sessions/s.", ""]
    lines += ["Server-side counters (deltas of `/metrics` over each run):", ""] + server_table(result["runs"]) + [""]
    lines += [f"![{name}]({path})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, stem: Path) -> dict[str, str]:
    """Write the PNGs; returns {caption: file name relative to the Markdown file}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, label in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT s", "TPOT s", "end-to-end s")):
        for r in result["runs"]:
            xs = sorted(c[key] for c in r["calls"] if c["ok"] and c.get(key) is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=_label(r))
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of calls")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # a bounded run may have completed no call
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    out["latency CDFs"] = _save(fig, stem, "latency")
    if len(result["runs"]) > 1 and not any("label" in r for r in result["runs"]):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        rates = [r["rate"] for r in result["runs"]]
        ax.plot(rates, [r["summary"]["output_tok_s"] for r in result["runs"]], "o-", label="output tok/s")
        ax2 = ax.twinx()
        ax2.plot(rates, [r["summary"]["goodput_rps"] for r in result["runs"]], "s--", color="C1",
                 label="goodput req/s")
        ax.set_xlabel("session arrivals/s")
        ax.set_ylabel("output tok/s")
        ax2.set_ylabel("goodput req/s")
        fig.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        out["throughput vs load"] = _save(fig, stem, "load")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in result["runs"]:
        pts = [(b["t_s"], b["hit_rate"]) for b in r["summary"]["hit_rate_over_time"] if b["hit_rate"] is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", label=_label(r))
    ax.set_xlabel("time s")
    ax.set_ylabel("prefix-cache hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out["hit rate over time"] = _save(fig, stem, "hits")
    return out


def _label(run: dict) -> str:
    return run.get("label") or f"{fmt(run['rate'])} sessions/s"


def _save(fig, stem: Path, kind: str) -> str:
    import matplotlib.pyplot as plt

    path = stem.parent / f"{stem.name}-{kind}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def write_report(result: dict, md_path: str | Path, title: str = "agentrt bench", command: str | None = None) -> None:
    md_path = Path(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    plots = plot(result, md_path.with_suffix(""))
    md_path.write_text(markdown(result, title, plots, command))
