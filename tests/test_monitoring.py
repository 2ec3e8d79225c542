"""The monitoring profile's files: the Grafana dashboard, its provisioning, Prometheus' scrape config and
the compose profile that starts them (docs/deploy.md, "Monitoring profile").

The dashboard is checked against the structure Grafana's dashboard JSON model requires (a small JSON
schema written from its documentation), and every metric name in every PromQL ``expr`` must be one
``agentrt serve`` / ``agentrt worker`` or ``agentrt router`` exposes: the expositions are rendered from
the same code their ``/metrics`` serves (``agentrt.metrics.Metrics`` with the engine collector, and with
``router.metrics.RouterCollector`` over a real ``RouterCore``), so a renamed metric fails here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agentrt.metrics import Metrics
from engine.types import EngineStats
from router.config import RouterConfig
from router.core import RouterCore
from router.metrics import RouterCollector

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "agentrt.json"

_DATASOURCE = {"type": "object", "required": ["type", "uid"],
               "properties": {"type": {"const": "prometheus"}, "uid": {"type": "string", "minLength": 1}}}
_GRID = {"type": "object", "required": ["x", "y", "w", "h"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 23},
                        "y": {"type": "integer", "minimum": 0},
                        "w": {"type": "integer", "minimum": 1, "maximum": 24},
                        "h": {"type": "integer", "minimum": 1}}}
_TARGET = {"type": "object", "required": ["refId", "expr", "datasource"],
           "properties": {"refId": {"type": "string", "minLength": 1}, "expr": {"type": "string", "minLength": 1},
                          "datasource": _DATASOURCE, "legendFormat": {"type": "string"}}}
_PANEL = {"type": "object", "required": ["id", "type", "title", "gridPos"],
          "properties": {"id": {"type": "integer", "minimum": 1}, "type": {"type": "string", "minLength": 1},
                         "title": {"type": "string", "minLength": 1}, "gridPos": _GRID},
          "if": {"properties": {"type": {"not": {"const": "row"}}}},
          "then": {"required": ["datasource", "targets"],
                   "properties": {"datasource": _DATASOURCE,
                                  "targets": {"type": "array", "minItems": 1, "items": _TARGET}}}}
# Grafana's dashboard JSON model (grafana.com/docs/grafana/latest/dashboards/build-dashboards/view-dashboard-json-model):
# the fields a provisioned dashboard needs, with the types Grafana reads them as.
DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "time", "templating"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "version": {"type": "integer"},
        "editable": {"type": "boolean"},
        "refresh": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "time": {"type": "object", "required": ["from", "to"]},
        "templating": {"type": "object", "required": ["list"],
                       "properties": {"list": {"type": "array", "items": {
                           "type": "object", "required": ["name", "type"],
                           "properties": {"name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                          "type": {"enum": ["datasource", "query", "custom", "constant",
                                                            "interval", "textbox", "adhoc"]}}}}}},
        "panels": {"type": "array", "minItems": 1, "items": _PANEL},
    },
}

# PromQL words that are not metric names: aggregations, functions, modifiers.
_PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
                 "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "rate", "irate", "increase", "delta", "histogram_quantile", "clamp_min", "clamp_max",
                 "abs", "label_values", "vector", "scalar", "time"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: string literals, label matchers, ranges, variables,
    ``by (...)`` label lists and function calls taken out; histogram and counter sample suffixes kept
    (they are checked against the exposition's sample names)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)              # string literals
    e = re.sub(r"\{[^}]*\}", "", e)                           # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                          # range selectors
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\$\w+", "", e)                               # dashboard variables
    e = re.sub(r"label_values\(([^,()]+),\s*\w+\s*\)", r"(\1)", e)  # a variable query: its label is no metric
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        called = e[m.end():].lstrip().startswith("(")
        if word in _PROMQL_WORDS or called or re.fullmatch(r"[0-9.e]+", word):
            continue
        names.add(word)
    return names


def test_metric_names_are_found_in_promql():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(agentrt_time_to_first_token_seconds_bucket'
            '{job=~"$job", route!~"/a|b"}[$__rate_interval]))) / max by (instance) (vllm:kv_cache_usage_perc)')
    assert metric_names(expr) == {"agentrt_time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc"}
    assert metric_names("label_values(agentrt_http_requests_total, job)") == {"agentrt_http_requests_total"}
    assert metric_names("sum(rate(agentrt_no_such_metric_total[5m])) * 2") == {"agentrt_no_such_metric_total"}


def _stats() -> EngineStats:
    return EngineStats(running=1, waiting=2, pages_total=100, pages_used=40, pages_free=60, pages_cached=30,
                       pages_pinned=5, num_pins=1, prompt_tokens_total=10, cached_tokens_total=4,
                       generation_tokens_total=3, num_preemptions=0, page_size=16, pages_evictable=20,
                       cpu_kernels={"decode_attention": True, "layer_ops": False})


def _sample_names(text: str) -> set[str]:
    """Every series name the exposition has or would have once a labelled family gets a child."""
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


def _router_exposition() -> str:
    """A router's /metrics: agentrt's HTTP metrics and ``RouterCollector`` over a real ``RouterCore`` (it
    reaches Redis only when started) with two decisions and one worker in flight recorded."""
    core = RouterCore(RouterConfig(redis_url="redis://127.0.0.1:1/0"), "m")
    core.decisions.update({"prefix": 2, "fallback": 1})
    core.workers["w0"] = None  # only the ids are read
    core.inflight.dispatched("r1", "w0", 32, 8)
    router = Metrics()
    router.attach(RouterCollector(core, type("Remote", (), {"failovers": 3})()))
    return router.render().decode()


@pytest.fixture(scope="module")
def exposed() -> set[str]:
    server = Metrics()
    server.attach_engine(_stats)
    return _sample_names(server.render().decode()) | _sample_names(_router_exposition())


def test_router_metrics_have_help_and_read_the_core():
    families = {f.name: f for f in text_string_to_metric_families(_router_exposition())}
    for name, family in families.items():
        assert len(family.documentation) >= 25 and family.documentation != name, name
    router = {n for n in families if n.startswith("agentrt_router_")}
    assert len(router) >= 12
    assert not any(n.startswith(("agentrt_engine_", "agentrt_kv_", "vllm:")) for n in families)  # workers' only
    decisions = {s.labels["reason"]: s.value for s in families["agentrt_router_decisions"].samples}
    assert decisions == {"prefix": 2.0, "fallback": 1.0}
    assert families["agentrt_router_failovers"].samples[0].value == 3.0
    assert families["agentrt_router_workers_live"].samples[0].value == 1.0
    (in_flight,) = families["agentrt_router_worker_in_flight"].samples
    assert (in_flight.labels, in_flight.value) == ({"worker": "w0"}, 1.0)


def test_dashboard_follows_grafana_json_model():
    dash = json.loads(DASHBOARD.read_text())
    jsonschema.validate(dash, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:  # no two panels overlap on Grafana's 24-column grid
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for other in dash["panels"]:
            o = other["gridPos"]
            if other is not panel:
                overlap = (g["x"] < o["x"] + o["w"] and o["x"] < g["x"] + g["w"]
                           and g["y"] < o["y"] + o["h"] and o["y"] < g["y"] + g["h"])
                assert not overlap, (panel["title"], other["title"])
    variables = {v["name"] for v in dash["templating"]["list"]}
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            used = set(re.findall(r"\$(?!__)(\w+)", target["expr"] + target["datasource"]["uid"]))
            assert used <= variables, (panel["title"], used - variables)
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for wanted in ("request rate", "time to first token", "time per output token", "prefix-cache hit ratio",
                   "kv pages used, pinned", "running and waiting", "routing decisions", "speculative",
                   "by worker"):
        assert wanted in titles, wanted


def test_every_dashboard_query_names_an_exposed_metric(exposed):
    dash = json.loads(DASHBOARD.read_text())
    queries = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    queries += [("variable " + v["name"], v["definition"]) for v in dash["templating"]["list"] if "definition" in v]
    assert len(queries) > 20
    for title, expr in queries:
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= exposed, f"{title}: {sorted(names - exposed)} not exposed by agentrt serve or router"


def test_compose_monitoring_profile_and_its_files():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    monitoring = {name for name, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    for name in monitoring:
        image = services[name]["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name} image {image!r} is not pinned"
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which does not exist"
    assert services["prometheus"]["ports"] == ["9090:9090"] and services["grafana"]["ports"] == ["3000:3000"]
    assert {"prometheus-data", "grafana-data"} <= set(compose["volumes"])
    # the agentrt services run without the profile
    assert all("profiles" not in services[n] for n in ("redis", "worker-0", "worker-1", "router-0", "router-1"))

    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: {t for c in j["static_configs"] for t in c["targets"]} for j in scrape["scrape_configs"]}
    listen = {}
    for name in ("worker-0", "worker-1", "router-0", "router-1"):
        cmd = services[name]["command"]
        listen[name] = f"{name}:{cmd[cmd.index('--port') + 1]}"
    assert jobs == {"agentrt-worker": {listen["worker-0"], listen["worker-1"]},
                    "agentrt-router": {listen["router-0"], listen["router-1"]}}

    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/agentrt.yaml").read_text())
    (provider,) = providers["providers"]
    mounted = {v.split(":")[1] for v in services["grafana"]["volumes"] if v.startswith("./grafana/agentrt.json")}
    assert mounted == {provider["options"]["path"] + "/agentrt.json"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_the_scrape_config():
    out = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_docs_table_lists_every_exposed_metric(exposed):
    """docs/deploy.md's "Metrics" table names every family serve, worker and router expose."""
    text = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    table = text[text.index("## Metrics"):text.index("## Model server protocol")]
    server = Metrics()
    server.attach_engine(_stats)
    names = {f.name + ("_total" if f.type == "counter" else "")
             for text in (server.render().decode(), _router_exposition())
             for f in text_string_to_metric_families(text)}
    assert len(names) > 40
    missing = sorted(n for n in names if f"`{n}`" not in table)
    assert not missing, missing
