"""What a verification step costs against a decode step, for the draft-length rule.

``DraftLength`` (engine/speculative.py) drafts the ``k`` that commits the most tokens per unit of
step cost, a verification of ``k`` drafts costing ``1 + FIXED + ROW * k`` decode steps. Those two
numbers depend on the machine, the dtype, the weights and the threads, so they are measured by
``benchmarks/step_cost.py`` (one decoding row timed with 0..K drafts, in alternating order) into
``benchmarks/results/step_cost.json``. The engine uses that file only when it was measured on the
same setup (device, CPU model, dtype, quantization, torch threads, packed float32 linear); otherwise it falls back to
``STEP_COST``, a constant from one old run (one thread, before the C kernels), and says so in its log.
"""

from __future__ import annotations

import json
from pathlib import Path

# 1 + FIXED + ROW x (tokens drafted) decode steps; from one run on a 2-core CPU at batch 1 with int4
# weights and one torch thread, before the C kernels (a decode step 30 ms, 1 draft 43 ms, 4: 64 ms).
# Used only where no measurement of this setup exists.
STEP_COST = (0.2, 0.23)   # (FIXED, ROW)
MEASURED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "step_cost.json"
# packed_linear: dense float32 projections through oneDNN (engine/models/packed_linear.py), whose cost at a
# few rows differs from F.linear's (MKL's generic path on AMD: 3 rows cost it 2x 1 row)
SETUP_KEYS = ("device", "cpu_model", "dtype", "quantization", "torch_threads", "packed_linear")
MIN_ROW = 1e-3            # DraftLength needs ROW > 0; a measured slope at or below 0 is clamped here


def fit_step_cost(ms_by_k: dict[int, float]) -> tuple[float, float]:
    """(FIXED, ROW): the least-squares line through ``ms_by_k[k] / ms_by_k[0] - 1`` for k >= 1.

    ``ms_by_k``: the median step time with ``k`` drafts; it must hold k = 0 and at least two k >= 1.
    FIXED is clamped at 0 and ROW at ``MIN_ROW`` (the rule's domain), never left negative."""
    ks = sorted(k for k in ms_by_k if k >= 1)
    if 0 not in ms_by_k or len(ks) < 2 or ms_by_k[0] <= 0:
        raise ValueError(f"need the step time at k=0 (> 0) and at two or more k >= 1, got {ms_by_k!r}")
    extra = [ms_by_k[k] / ms_by_k[0] - 1.0 for k in ks]
    mean_k, mean_e = sum(ks) / len(ks), sum(extra) / len(extra)
    row = sum((k - mean_k) * (e - mean_e) for k, e in zip(ks, extra)) / sum((k - mean_k) ** 2 for k in ks)
    fixed = mean_e - row * mean_k
    return max(0.0, fixed), max(MIN_ROW, row)


def step_cost_for(setup: dict, path: Path = MEASURED) -> tuple[tuple[float, float], str]:
    """(FIXED, ROW) for this setup and why: measured where ``path`` was measured on the same
    ``setup`` (``SETUP_KEYS``), else ``STEP_COST`` with the reason it is unmeasured."""
    if not path.is_file():
        return STEP_COST, f"unmeasured: no {path.name} (run benchmarks/step_cost.py); constant {STEP_COST}"
    result = json.loads(path.read_text())
    recorded = result.get("setup", {})
    differ = [f"{key} {recorded.get(key)!r} there, {setup.get(key)!r} here"
              for key in SETUP_KEYS if recorded.get(key) != setup.get(key)]
    if differ:
        return STEP_COST, f"unmeasured on this setup ({path.name}: {'; '.join(differ)}); constant {STEP_COST}"
    fixed, row = result["step_cost"]
    if not (fixed >= 0 and row > 0):
        raise ValueError(f"{path}: step_cost must be (fixed >= 0, row > 0), got {result['step_cost']!r}")
    return (float(fixed), float(row)), f"measured by benchmarks/step_cost.py ({path.name})"
