"""``agentrt bench``: the agentic workload against any OpenAI-compatible URL, and the ablation ladder.

Importable: ``run_bench(BenchOptions(...))`` returns the result dict that ``--json`` writes;
``write_report`` renders it as Markdown with PNG plots. See docs/benchmarking.md.
"""

from agentrt.bench.bench import BenchOptions, run_bench
from agentrt.bench.report import write_json, write_report
from agentrt.bench.summary import SLO

__all__ = ["SLO", "BenchOptions", "run_bench", "write_json", "write_report"]
