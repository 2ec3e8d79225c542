"""What every benchmark script shares: its common flags, the header every result carries, the order
sides run in, per-run figures with their median and range, and the one JSON writer.

    parser = argparse.ArgumentParser(...)
    harness.add_common_args(parser)                  # --json PATH, --repeats N, --order alternate|fixed
    args = parser.parse_args(argv)
    run = harness.Run(args, __file__)                # notes the start time and the command line
    for repeat, side in harness.ab_order(["off", "on"], args.repeats, args.order): ...
    run.add_server("agentrt", cmd, harness.non_default_flags(extra_flags))
    run.write({"figures": ...}, engine=engine)       # {"header": ..., "figures": ...} to --json

The header (``SCHEMA``; docs/benchmarking.md lists it) records what a reader needs to trust or rerun a
figure: the commit and whether the tree was dirty (with the hash of ``git diff HEAD``), the machine
(engine/cpu_info.py), torch's version and threads, the OpenMP variables, which C kernels loaded, the
engine's dtype / quantization / speculation, every server started with its non-default flags, the
order sides ran in and how many repeats, and the host's load average when the run started and ended
(``loadavg``: a run on a host busy with other work says so; not in ``HEADER_KEYS``, which older
results lack).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from engine.cpu_info import AVX2_ONLY_ENV

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "agentrt-bench/1"
ORDERS = ("alternate", "fixed")
# environment variables that change what runs (threads; the kernels' -march; torch's, oneDNN's and MKL's ISA caps,
# the variables engine/cpu_info.py AVX2_ONLY_ENV sets)
ENV_RECORDED = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", *AVX2_ONLY_ENV)
HEADER_KEYS = ("schema", "script", "argv", "commit", "dirty", "diff_sha256", "machine", "torch", "env", "kernels",
               "engine", "servers", "order", "repeats", "started_at", "finished_at")
HEADER_ADDED = ("loadavg",)   # keys added since the first results (a header has them after HEADER_KEYS)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def add_common_args(parser: argparse.ArgumentParser, repeats: int | None = 1, order: str = "alternate",
                    json_required: bool = False) -> None:
    """``--json PATH``, ``--repeats N`` and ``--order alternate|fixed`` with their help; ``repeats=None``:
    ``--json`` only, for a script that compares no sides (a flag it would ignore is not offered)."""
    parser.add_argument("--json", type=Path, default=None, required=json_required, metavar="PATH",
                        help="write the results here, under the header every result carries (commit, dirty "
                             "tree, machine, threads, kernels, servers and their flags)")
    if repeats is None:
        return
    parser.add_argument("--repeats", type=_positive, default=repeats, metavar="N",
                        help=f"run the whole comparison N times; each side's per-run figures and their median "
                             f"and range are reported (default {repeats})")
    parser.add_argument("--order", choices=ORDERS, default=order,
                        help="alternate: sides in ABBA order over the repeats (A B, B A, A B, ...), so neither "
                             f"always goes first; fixed: the same order every repeat (default {order})")


def ab_order(sides: Sequence[str], repeats: int, order: str = "alternate") -> list[tuple[int, str]]:
    """The sequence of ``(repeat, side)`` to run: ``alternate`` reverses the sides every other repeat
    (two sides: A B B A A B B A ...), ``fixed`` keeps them as given."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if repeats < 1 or not sides:
        raise ValueError(f"need repeats >= 1 and at least one side, got {repeats} and {list(sides)}")
    seq = []
    for r in range(repeats):
        names = list(sides) if order == "fixed" or r % 2 == 0 else list(reversed(sides))
        seq += [(r, s) for s in names]
    return seq


def spread(values: Iterable[float | None]) -> dict:
    """Per-run values (``None`` kept, in run order) with the median, min and max of those present."""
    runs = list(values)
    xs = [v for v in runs if v is not None]
    return {"runs": runs, "median": statistics.median(xs) if xs else None,
            "min": min(xs) if xs else None, "max": max(xs) if xs else None}


def git_state(repo: Path = REPO) -> dict:
    """HEAD's commit; ``dirty`` when tracked files differ from it or untracked files exist;
    ``diff_sha256``: SHA-256 of ``git diff HEAD --binary`` (``None`` when clean)."""
    def git(*cmd: str) -> str:
        out = subprocess.run(["git", *cmd], cwd=repo, capture_output=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"git {' '.join(cmd)} in {repo}: {out.stderr.decode(errors='replace').strip()}")
        return out.stdout.decode(errors="replace")

    commit = git("rev-parse", "HEAD").strip()
    diff = git("diff", "HEAD", "--binary")
    dirty = bool(diff) or bool(git("status", "--porcelain").strip())
    return {"commit": commit, "dirty": dirty,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if dirty else None}


def non_default_flags(flags: Sequence[str], ignore: Iterable[str] = ("--port", "--host")) -> dict:
    """``["--dtype", "float32", "--no-repack", "-np", "4"]`` -> ``{"--dtype": "float32", "--no-repack": True,
    "-np": "4"}`` (``--x=v`` too); ``ignore``: flags every start sets (the port)."""
    out: dict[str, Any] = {}
    skip = set(ignore)
    i = 0
    while i < len(flags):
        flag = flags[i]
        name, eq, value = flag.partition("=")
        has_value = not eq and i + 1 < len(flags) and not flags[i + 1].startswith("-")
        if eq:
            val = value
        elif has_value:
            val = flags[i + 1]
        else:
            val = True
        if name not in skip:
            out[name] = val
        i += 2 if has_value else 1
    return out


def engine_settings(config: Any, model: str | None = None) -> dict:
    """dtype, quantization, speculation and attention an ``EngineConfig`` resolves to on this machine."""
    from engine.loader import gguf_weight_types, resolve_model

    path, _ = resolve_model(model)
    return {"dtype": config.resolved_dtype(), "quantization": config.resolved_quantization(gguf_weight_types(path)),
            "speculative": config.resolved_speculative(), "device": config.resolved_device(),
            "attention_backend": config.resolved_backend(), "cpu_kernels": config.cpu_kernels}


def serve_settings(flags: Sequence[str] = ()) -> dict:
    """What ``agentrt serve *flags`` runs with here (its defaults, ``AGENTRT_*`` env, then ``flags``)."""
    from agentrt_cli import build_parser
    from agentrt.config import ServerConfig

    args = build_parser().parse_args(["serve", *flags])
    cfg = ServerConfig.from_args(args)
    return engine_settings(cfg.engine_config(), getattr(args, "model", None))


def _engine_of(engine: Any) -> dict:
    """An in-process engine's settings as they took effect."""
    return {"dtype": engine.config.resolved_dtype(), "quantization": engine.quantization,
            "speculative": engine.speculative, "device": engine.device, "attention": engine.attention_desc}


class Run:
    """One benchmark run: its flags, start time and servers; ``write`` puts the header on the results."""

    def __init__(self, args: argparse.Namespace | None, script: str, argv: Sequence[str] | None = None) -> None:
        self.args = args
        self.script = os.path.relpath(Path(script).resolve(), REPO)
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.started_at = _now()
        self.load_at_start = _loadavg()
        self.servers: list[dict] = []

    def add_server(self, name: str, cmd: Sequence[str], flags: dict) -> None:
        """A server this run started: its command line and the flags it got beyond its defaults."""
        self.servers.append({"name": name, "cmd": [str(c) for c in cmd], "non_default_flags": dict(flags)})

    def header(self, engine: Any = None, settings: dict | None = None, kernels: dict | None = None) -> dict:
        """The header (``HEADER_KEYS``); ``engine``: an in-process engine, else ``settings`` (a server's,
        e.g. ``serve_settings``); ``kernels``: else the engine's active ones, else those this process loads."""
        import torch

        from engine.cpu_info import machine

        if kernels is None:
            kernels = engine.active_kernels if engine is not None else loaded_kernels()
        return {"schema": SCHEMA, "script": self.script, "argv": self.argv, **git_state(),
                "machine": machine(), "torch": {"version": torch.__version__, "threads": torch.get_num_threads()},
                "env": {k: os.environ.get(k) for k in ENV_RECORDED},
                "kernels": dict(kernels), "engine": _engine_of(engine) if engine is not None else settings,
                "servers": self.servers, "order": getattr(self.args, "order", None),
                "repeats": getattr(self.args, "repeats", None), "started_at": self.started_at, "finished_at": _now(),
                "loadavg": {"start": self.load_at_start, "end": _loadavg()}}

    def write(self, body: dict, engine: Any = None, settings: dict | None = None, kernels: dict | None = None,
              path: Path | str | None = None) -> dict:
        """``{"header": ..., **body}``, written to ``path`` (default ``--json``) when there is one."""
        result = {"header": self.header(engine, settings, kernels), **body}
        target = path if path is not None else getattr(self.args, "json", None)
        if target:
            write_json(target, result)
            print(f"wrote {target}", flush=True)
        return result


def write_json(path: Path | str, result: dict) -> None:
    """The one JSON writer: indented, parents made, a trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def _loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _prefill_runs(prefill) -> bool:
    """Whether an engine of this CPU's default dtype on the default model's heads takes the prefill kernel: in
    bfloat16 where it runs vdpbf16ps, else in float32 where its float32 path is vectorized (AVX); either only
    where the start-up probe times it faster than torch's path."""
    import torch

    from engine.attention.torch_backend import prefill_kernel_wins
    dtype = torch.bfloat16 if prefill.dpbf16 else torch.float32
    return prefill.vectorized(dtype) and prefill_kernel_wins(prefill, 9, 3, 64, dtype)


def loaded_kernels() -> dict[str, bool]:
    """Whether each C kernel library (engine/cpu_build.py KERNELS) builds and loads in this process (built
    now unless cached), for a result with no engine in-process; an engine reports the ones it runs
    (``LLMEngine.active_kernels``)."""
    from engine.attention import cpu_kernel
    from engine.models import cpu_ops, decode_step, qmatmul
    prefill = cpu_kernel.load_prefill()
    return {"decode_attention": cpu_kernel.load() is not None,
            # bfloat16 on vdpbf16ps or float32 on AVX, where it measures faster than torch (the default model's heads)
            "prefill_attention": prefill is not None and _prefill_runs(prefill),
            "layer_ops": cpu_ops.load() is not None, "qmatmul": qmatmul.load() is not None,
            # run by a float32 engine on GGUF blocks (a CPU without native bf16, or --dtype float32)
            "decode_step": decode_step._library() is not None}
