"""The ablation as a terminal table and a Markdown report (with the latency and hit-rate plots)."""

from __future__ import annotations

from pathlib import Path

from agentrt.bench.report import fmt, plot


def _factor(x: float | None) -> str:
    if x is None:
        return "n/a"
    return "inf" if x == float("inf") else f"{x:.2f}x"


def step_rows(result: dict) -> list[str]:
    rows = ["| step | switches | API | policy | cache | pins | calls ok | out tok/s | total tok/s | TTFT p50 s | "
            "TTFT p99 s | TPOT p50 s | hit rate | goodput req/s | attainment | $/M out | $/M total |",
            "|" + "---|" * 17]
    for s in result["steps"]:
        st, m = s["step"], s["run"]["summary"]
        cost = m.get("cost") or {}
        pins = "n/a" if st["api"] == "chat" else ("on" if st["pins"] else "1 ms")
        rows.append(
            f"| {st['name']} | {st['component'] or '-'} | {st['api']} | {st['policy']} | "
            f"{'on' if st['prefix_cache'] else 'off'} | {pins} | {m['calls_ok']}/{m['calls']} | "
            f"{fmt(m['output_tok_s'])} | {fmt(m['total_tok_s'])} | {fmt(m['ttft_s']['p50'])} | "
            f"{fmt(m['ttft_s']['p99'])} | {fmt(m['tpot_s']['p50'])} | {fmt(m['hit_rate'])} | {fmt(m['goodput_rps'])} | "
            f"{fmt(m['attainment'])} | {fmt(cost.get('per_million_output_tokens'))} | "
            f"{fmt(cost.get('per_million_total_tokens'))} |")
    return rows


def factor_rows(result: dict) -> list[str]:
    rows = ["| component | step vs base | goodput | output throughput | p99 TTFT (lower is better, base/step) |",
            "|---|---|---|---|---|"]
    for f in result["factors"]:
        rows.append(f"| {f['component']} | {f['step']} vs {f['base']} | {_factor(f['goodput'])} | "
                    f"{_factor(f['throughput'])} | {_factor(f['ttft_p99'])} |")
    for n in result["not_measured"]:
        rows.append(f"| {n['component']} | not measured: {n['reason']} | | | |")
    return rows


def print_ablation(result: dict) -> None:
    print("\n".join(step_rows(result)))
    print()
    print("\n".join(factor_rows(result)))


def ablation_markdown(result: dict, md_path: str | Path, command: str | None) -> None:
    md_path = Path(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    runs = [s["run"] for s in result["steps"]]
    plots = plot({"runs": runs}, md_path.with_suffix("")) if runs else {}
    o, m, a = result["options"], result["machine"], result["ablation"]
    slo = o["slo"]
    lines = ["# agentrt ablation", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    lines += [f"Machine: {m['processor']}, {m['cpus']} CPUs, {m['platform']}"
              + (f", GPU {m['cuda']}." if m.get("cuda") else "; no GPU: **these are CPU figures**."),
              f"Deployment per step: {a['workers']} `agentrt worker` processes behind one `agentrt router` and "
              f"a private Redis (KV pool {a['kv_cache_tokens'] or 'default'} tokens per worker), caches flushed "
              f"before each step. Model: {a['model'] or 'the default model'}; `{runs[0]['model'] if runs else ''}`.",
              f"Workload: preset `{o['preset']}`, {o['sessions']} sessions, seed {o['seed']}, turns capped at "
              f"{o['max_turns']}, replies capped at {o['max_reply_tokens']} tokens, think time x{o['think_scale']}; "
              f"same requests in every step.",
              f"SLO: TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s']} s per call; goodput = calls meeting it "
              f"per second of the step's wall time.",
              (f"Cost: ${o['price_per_worker_hour']} per worker-hour x {a['workers']} workers."
               if o.get("price_per_worker_hour") is not None else "Cost: no price given."), "",
              "## Steps", ""] + step_rows(result) + ["", "## What each component contributes", ""]
    lines += factor_rows(result) + [""]
    lines += [f"![{name}]({path})" for name, path in plots.items()]
    md_path.write_text("\n".join(lines) + "\n")
