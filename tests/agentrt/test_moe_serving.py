"""A tiny MoE checkpoint served by the real ``agentrt serve``: with ``--ep-size 2`` (a second rank
in its own process, gloo) the HTTP API gives the same greedy output as without expert
parallelism; stopping the server stops its expert-parallel rank; ``--ep-size`` the model cannot
use fails at start with a clear message."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from benchmarks.moe_checkpoint import save_tokenizer, write_tiny_checkpoint
from engine.loader.gguf_loader import default_model_path, load_gguf

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen2-moe"
PROMPTS = ("The capital of France is", "def fibonacci(n):")
CHAT = [{"role": "user", "content": "Name three colours."}]
CLEAN_EXIT = (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after its graceful shutdown


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("moe_serving") / MODEL, "qwen2_moe", seed=3, vocab_size=49152)
    save_tokenizer(load_gguf(default_model_path())[2], d)
    return str(d)


def _greedy_replies(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = []
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        out.append(r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    out.append(r.choices[0].message.content)
    assert r.usage.completion_tokens >= 1
    return out


def test_ep2_over_http_equals_single_process(checkpoint, start_agentrt_server, tmp_path):
    single = start_agentrt_server(tmp_path, "--model", checkpoint)
    try:
        expected = _greedy_replies(single.url)
    finally:
        assert single.stop() in CLEAN_EXIT
    server = start_agentrt_server(tmp_path, "--model", checkpoint, "--ep-size", "2", "--ep-placement", "balanced")
    try:
        children = _children(server.process.pid)  # the rank, and multiprocessing's resource tracker
        assert sum("spawn_main" in cmd for cmd in children.values()) == 1, children
        assert _greedy_replies(server.url) == expected
    finally:
        assert server.stop() in CLEAN_EXIT, server.log()[-3000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(_alive, children)):
        time.sleep(0.1)
    assert not any(map(_alive, children)), children


@pytest.mark.slow
def test_ep_that_does_not_divide_the_experts_fails_at_start(checkpoint):
    proc = subprocess.run([sys.executable, "-m", "agentrt_cli", "serve", "--model", checkpoint, "--ep-size", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "ep_size=3 must divide the expert slot count: 8 experts + 0 redundant = 8 slots" in proc.stderr


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of the live children of ``pid`` (Linux /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and _alive(int(d.name)):
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == pid:
                    out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie has exited)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
