"""``agentrt serve``'s ``/metrics``: a real server (one running slot, so a second request waits), parsed
with prometheus_client's own parser (and ``promtool check metrics`` when it is installed).

Every family must have a HELP line that says what it counts; the model server protocol's gauges
(docs/deploy.md, "Model server protocol") must exist and follow the engine: the queue length counts
a request held waiting, the running count the one holding the slot, and the KV utilisation rises
while a request or a session pin holds pages and falls back once nothing holds them (cached but
evictable prefixes count as free).
"""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest
from agentrt_test_helpers import MODEL, wait_for
from prometheus_client.parser import text_string_to_metric_families

from agentrt.metrics import PROTOCOL_METRICS
from agentrt.procs import tls_context


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_agentrt_server):
    server = start_agentrt_server(tmp_path_factory.mktemp("metrics"), "--kv-cache-tokens", "4096",
                                  "--max-num-seqs", "1")
    yield server
    server.stop()


def scrape(url: str) -> dict:
    """``{family name: family}`` of one scrape (one engine stats snapshot)."""
    text = httpx.get(url + "/metrics", timeout=10, verify=tls_context()).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str) -> float:
    (sample,) = families[name].samples
    return sample.value


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_every_family_has_a_help_that_says_what_it_counts(server):
    complete(server.url, "Name three colours:")  # labelled families get their first children
    families = scrape(server.url)
    assert len(families) >= 25
    for name, family in families.items():
        assert family.type in ("counter", "gauge", "histogram"), name
        assert len(family.documentation) >= 25 and family.documentation != name, (name, family.documentation)
        assert "_created" not in name
    for protocol_name in PROTOCOL_METRICS.values():
        assert families[protocol_name].type == "gauge", protocol_name
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert info.labels == {"block_size": "16", "num_gpu_blocks": str(int(value(families, "agentrt_kv_pages_capacity")))}
    assert 0.0 <= value(families, "vllm:kv_cache_usage_perc") <= 1.0
    requests = {(s.labels["route"], s.labels["status"]): s.value for s in families["agentrt_http_requests"].samples}
    assert requests[("/v1/completions", "200")] >= 1


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_the_exposition(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    # 0: clean; 3: lint findings. The only ones allowed: the protocol's names, which are vLLM's and carry a colon.
    assert out.returncode in (0, 3), out.stdout + out.stderr
    findings = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    allowed = {f"{name} metric names should not contain ':'" for name in PROTOCOL_METRICS.values()}
    assert set(findings) <= allowed, findings


def test_queue_length_counts_a_request_held_waiting(server):
    holder = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 1000, "ignore_eos": True,
              "temperature": 0, "stream": True}
    queued = {"model": MODEL, "prompt": "Spell a word:", "max_tokens": 2, "ignore_eos": True,
              "temperature": 0, "stream": True}
    assert wait_for(lambda: value(scrape(server.url), "vllm:num_requests_running") == 0)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        first = http.send(http.build_request("POST", "/v1/completions", json=holder), stream=True)
        second = None
        try:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
            assert next(lines).startswith("data: ")  # a token: it holds the only running slot
            second = http.send(http.build_request("POST", "/v1/completions", json=queued), stream=True)
            assert second.status_code == 200
            assert wait_for(lambda: value(scrape(server.url), "vllm:num_requests_waiting") == 1, timeout_s=30), \
                {n: value(scrape(server.url), n) for n in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                                           "agentrt_requests_in_flight")}
            held = scrape(server.url)
            assert value(held, "vllm:num_requests_running") == value(held, "agentrt_engine_running") == 1
            assert value(held, "vllm:num_requests_waiting") == value(held, "agentrt_engine_waiting") == 1
            assert value(held, "vllm:kv_cache_usage_perc") > 0  # the running request holds its pages
        finally:
            first.close()  # the client goes away: the holder is aborted and frees the slot
        assert "data: [DONE]" in list(second.iter_lines())  # the queued request then runs to its end
        second.close()
    assert wait_for(lambda: value(scrape(server.url), "vllm:num_requests_waiting") == 0)
    assert wait_for(lambda: value(scrape(server.url), "vllm:num_requests_running") == 0)


def test_kv_utilisation_follows_what_holds_pages(server):
    def settled() -> dict:
        assert wait_for(lambda: value(scrape(server.url), "agentrt_engine_running") == 0)
        return scrape(server.url)

    def utilisation(f: dict) -> float:
        used, evictable = value(f, "agentrt_kv_pages_used"), value(f, "agentrt_kv_pages_evictable")
        return (used - evictable) / value(f, "agentrt_kv_pages_capacity")

    complete(server.url, "The history of the printing press, in short: " * 4)
    idle = settled()
    assert value(idle, "agentrt_kv_pages_used") > 0  # the prompt's prefix stays cached...
    assert value(idle, "agentrt_kv_pages_evictable") == value(idle, "agentrt_kv_pages_used")
    assert value(idle, "vllm:kv_cache_usage_perc") == 0.0  # ...but nothing holds it: free for the picker

    with httpx.Client(base_url=server.url, timeout=120) as http:
        session = http.post("/v1/sessions", json={"system": "You are terse. " * 20, "pin_ttl_s": 120})
        assert session.status_code == 201, session.text
        sid = session.json()["id"]
        turn = http.post(f"/v1/sessions/{sid}/turns",
                         json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})
        assert turn.status_code == 200, turn.text
        assert wait_for(lambda: value(scrape(server.url), "agentrt_kv_pages_pinned") > 0)
        pinned = settled()
        assert value(pinned, "vllm:kv_cache_usage_perc") > 0  # the session's pin holds its KV between turns
        assert value(pinned, "vllm:kv_cache_usage_perc") == pytest.approx(utilisation(pinned))
        assert value(pinned, "vllm:kv_cache_usage_perc") >= (value(pinned, "agentrt_kv_pages_pinned")
                                                            / value(pinned, "agentrt_kv_pages_capacity"))
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    assert wait_for(lambda: value(scrape(server.url), "vllm:kv_cache_usage_perc") == 0.0, timeout_s=30)


def test_the_active_c_kernels_are_exposed(server):
    """``agentrt_cpu_kernel_active{kernel=...}``: one series per C kernel, 1 where the engine runs it.
    The decode-attention kernel runs wherever a compiler built it (page size 16 divides its chunks)."""
    from engine.cpu_build import KERNELS, no_compiler_reason
    families = scrape(server.url)
    active = {s.labels["kernel"]: s.value for s in families["agentrt_cpu_kernel_active"].samples}
    assert set(active) == set(KERNELS)
    assert active["decode_attention"] == (1.0 if no_compiler_reason() is None else 0.0)


def test_kernel_gauge_follows_the_engine_stats():
    from engine.types import EngineStats
    from agentrt.metrics import Metrics
    m = Metrics()
    m.attach_engine(lambda: EngineStats(running=0, waiting=0, pages_total=1, pages_used=0, pages_free=1,
                                        pages_cached=0, pages_pinned=0, num_pins=0, prompt_tokens_total=0,
                                        cached_tokens_total=0, generation_tokens_total=0, num_preemptions=0,
                                        page_size=16, cpu_kernels={"decode_attention": True, "layer_ops": False}))
    text = m.render().decode()
    assert 'agentrt_cpu_kernel_active{kernel="decode_attention"} 1.0' in text
    assert 'agentrt_cpu_kernel_active{kernel="layer_ops"} 0.0' in text
