"""One definition of an agentrt cluster, rendered for Docker Compose and for Kubernetes.

    python deploy/render.py            # rewrite the rendered files below from CLUSTER and GPU_CLUSTER
    python deploy/render.py --check    # exit 1 (and name them) if a committed file differs from a fresh render

Rendered files (never edit them by hand; edit :class:`Cluster` or the two specs at the bottom and rerun):

* ``deploy/compose.yaml``: Redis, the workers, the routers and the ``monitoring`` profile on one Docker host;
* ``deploy/prometheus/prometheus.yml``: the monitoring profile's scrape targets (every worker and router);
* ``deploy/k8s/cpu/agentrt.yaml`` and ``deploy/k8s/gpu/agentrt.yaml``: the same cluster on Kubernetes (one
  ``nvidia.com/gpu`` per worker in the second), each with a ``kustomization.yaml`` beside it.

The command line and the ``AGENTRT_*`` environment of a worker and of a router are built once
(:func:`worker_command`, :func:`router_command`, :func:`agentrt_env`) and used by both targets, so
compose and Kubernetes cannot drift on flags or env; flag and variable names come from the settings
models themselves (``agentrt/config.py``, ``router/config.py``), so a renamed setting fails here.
``tests/test_deploy_k8s.py`` checks the committed files against a fresh render, every Kubernetes
document against the Kubernetes schemas, and every rendered command against the real parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
if str(ROOT) not in sys.path:  # `python deploy/render.py` from a checkout
    sys.path.insert(0, str(ROOT))

from agentrt.config import RouterServerConfig, ServerConfig  # noqa: E402
from router.config import RouterConfig, WorkerSettings  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Resources:
    """A container's requests and limits (Kubernetes quantities); ``gpus``: ``nvidia.com/gpu`` (limit = request)."""

    cpu_request: str
    cpu_limit: str
    memory_request: str
    memory_limit: str
    gpus: int = 0

    def k8s(self) -> dict[str, Any]:
        requests = {"cpu": self.cpu_request, "memory": self.memory_request}
        limits = {"cpu": self.cpu_limit, "memory": self.memory_limit}
        if self.gpus:  # an extended resource: its request must equal its limit
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = self.gpus
        return {"requests": requests, "limits": limits}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Everything both targets are rendered from.

    ``drain_timeout_s`` is every agentrt process's ``--shutdown-timeout-s``. A worker's SIGTERM drains it
    (``router/worker.py``: /health 503, unregistered from Redis, new generations 503 ``worker_draining``)
    and waits up to that long for its requests in flight; uvicorn's graceful shutdown then waits up to
    that long again for open connections, and the engine's shutdown once more for running requests: at
    worst three timeouts, so a worker's grace period is ``3 * drain_timeout_s + grace_margin_s``. A router
    has no drain of its own: uvicorn's graceful shutdown (one timeout) and the remote engine's (one
    more), after a ``router_pre_stop_s`` pause in Kubernetes while its Service stops sending it
    connections.
    """

    name: str = "agentrt"
    image: str = "agentrt:latest"               # workers and routers (deploy/Dockerfile, CPU)
    worker_image: str | None = None             # workers' own image (None: ``image``), e.g. a CUDA build
    redis_image: str = "redis:7"
    workers: int = 2
    routers: int = 2
    worker_port: int = 8100
    router_port: int = 8000
    router_host_port: int = 8000                # compose: router-i is published on router_host_port + i
    redis_port: int = 6379
    redis_db: int = 0
    redis_storage: str = "1Gi"                  # Kubernetes: Redis's PersistentVolumeClaim
    kv_cache_tokens: int = 32768
    device: str | None = None                   # --device (None: the default, cpu)
    drain_timeout_s: int = 30
    grace_margin_s: int = 30
    router_pre_stop_s: int = 5
    worker_resources: Resources = Resources("2", "4", "4Gi", "6Gi")
    router_resources: Resources = Resources("500m", "2", "1Gi", "2Gi")
    redis_resources: Resources = Resources("250m", "1", "512Mi", "1Gi")

    @property
    def worker_grace_s(self) -> int:
        return 3 * self.drain_timeout_s + self.grace_margin_s

    @property
    def router_grace_s(self) -> int:
        return self.router_pre_stop_s + 2 * self.drain_timeout_s + self.grace_margin_s

    # Kubernetes object names (Services are DNS names: the URLs below use them)
    @property
    def worker_service(self) -> str:
        return f"{self.name}-worker"

    @property
    def router_service(self) -> str:
        return f"{self.name}-router"

    @property
    def redis_service(self) -> str:
        return f"{self.name}-redis"

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"


# ------------------------------------------------------------ commands and env (both targets)


def _flags(cls: type, **values: Any) -> list[str]:
    """``--flag value`` for each setting of ``cls`` named by keyword (the flag's name from the model)."""
    out: list[str] = []
    for name, value in values.items():
        if value is not None:
            out += [cls.flag_name(name), str(value)]
    return out


def worker_command(c: Cluster, worker_id: str, advertise_url: str) -> list[str]:
    """``agentrt worker`` with this cluster's flags; ``worker_id`` and ``advertise_url`` are each target's."""
    return ["agentrt", "worker",
            *_flags(ServerConfig, host="0.0.0.0", port=c.worker_port),
            *_flags(WorkerSettings, worker_id=worker_id, advertise_url=advertise_url),
            *_flags(ServerConfig, kv_cache_tokens=c.kv_cache_tokens, device=c.device,
                    shutdown_timeout_s=c.drain_timeout_s)]


def router_command(c: Cluster) -> list[str]:
    return ["agentrt", "router", *_flags(RouterServerConfig, host="0.0.0.0", port=c.router_port,
                                         shutdown_timeout_s=c.drain_timeout_s)]


def agentrt_env(c: Cluster, redis_host: str) -> dict[str, str]:
    """The ``AGENTRT_*`` variables every worker and router gets; ``redis_host``: each target's Redis name."""
    return {RouterConfig.env_name("redis_url"): f"redis://{redis_host}:{c.redis_port}/{c.redis_db}"}


# ------------------------------------------------------------ Docker Compose

COMPOSE_REDIS = "redis"  # service names on the compose network
COMPOSE_HEADER = """\
# A cluster on one Docker host: Redis, {workers} workers and {routers} router replicas.
#   docker compose -f deploy/compose.yaml up --build
# The API is on {router_urls};
# the routers agree on every routing decision because everything they route on is in Redis.
# Workers stay on the private network: their /internal/* endpoints carry no API key. On GPU hosts
# give each worker a GPU, the service's
#   deploy: {{resources: {{reservations: {{devices: [{{driver: nvidia, count: 1, capabilities: [gpu]}}]}}}}}}
# and `--device cuda` (docs/deploy.md). A stopped worker drains (docs/deploy.md, "Failure behaviour")
# within its stop_grace_period.
#
# Monitoring profile: Prometheus (http://localhost:9090) scraping every worker and router, and Grafana
# (http://localhost:3000, the agentrt dashboard provisioned; anonymous viewers, admin/admin to edit):
#   docker compose -f deploy/compose.yaml --profile monitoring up --build
#
# Rendered by deploy/render.py (with deploy/k8s/, from the same flags and env): edit that, then
#   python deploy/render.py
"""


def compose_worker(i: int) -> str:
    return f"worker-{i}"


def compose_router(i: int) -> str:
    return f"router-{i}"


def compose(c: Cluster) -> dict[str, Any]:
    def agentrt(command: list[str], grace_s: int) -> dict[str, Any]:
        return {"build": {"context": "..", "dockerfile": "deploy/Dockerfile"}, "image": c.image,
                "restart": "unless-stopped", "depends_on": {COMPOSE_REDIS: {"condition": "service_healthy"}},
                "environment": agentrt_env(c, COMPOSE_REDIS), "command": command,
                "stop_grace_period": f"{grace_s}s"}

    services: dict[str, Any] = {COMPOSE_REDIS: {
        "image": c.redis_image, "command": ["redis-server", "--appendonly", "yes"], "volumes": ["redis-data:/data"],
        "healthcheck": {"test": ["CMD", "redis-cli", "ping"], "interval": "2s", "retries": 30}}}
    for i in range(c.workers):
        name = compose_worker(i)
        services[name] = agentrt(worker_command(c, name, f"http://{name}:{c.worker_port}"), c.worker_grace_s)
    for i in range(c.routers):
        services[compose_router(i)] = {**agentrt(router_command(c), c.router_grace_s),
                                       "ports": [f"{c.router_host_port + i}:{c.router_port}"]}
    services["prometheus"] = {
        "profiles": ["monitoring"], "image": "prom/prometheus:v2.53.1", "restart": "unless-stopped",
        "command": ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.retention.time=7d"],
        "volumes": ["./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro", "prometheus-data:/prometheus"],
        "ports": ["9090:9090"]}
    services["grafana"] = {
        "profiles": ["monitoring"], "image": "grafana/grafana:11.1.0", "restart": "unless-stopped",
        "depends_on": ["prometheus"],
        "environment": {"GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": "/var/lib/grafana/dashboards/agentrt.json"},
        "volumes": ["./grafana/provisioning:/etc/grafana/provisioning:ro",
                    "./grafana/agentrt.json:/var/lib/grafana/dashboards/agentrt.json:ro",
                    "grafana-data:/var/lib/grafana"],
        "ports": ["3000:3000"]}
    return {"services": services, "volumes": {"redis-data": None, "prometheus-data": None, "grafana-data": None}}


PROMETHEUS_HEADER = """\
# Prometheus for the `monitoring` profile of deploy/compose.yaml: scrapes every agentrt process's
# /metrics on the compose network. Workers are model servers (engine, KV cache and the model server
# protocol's vllm:* gauges); routers carry the HTTP metrics of the public API and agentrt_router_*.
# The job label is what the Grafana dashboard's "Job" variable selects; `instance` is the worker.
# Rendered by deploy/render.py (its targets are compose.yaml's workers and routers).
"""


def prometheus(c: Cluster) -> dict[str, Any]:
    def job(name: str, targets: list[str]) -> dict[str, Any]:
        return {"job_name": name, "metrics_path": "/metrics", "static_configs": [{"targets": targets}]}

    return {"global": {"scrape_interval": "5s", "evaluation_interval": "15s"},
            "scrape_configs": [
                job("agentrt-worker", [f"{compose_worker(i)}:{c.worker_port}" for i in range(c.workers)]),
                job("agentrt-router", [f"{compose_router(i)}:{c.router_port}" for i in range(c.routers)])]}


# ------------------------------------------------------------ Kubernetes

K8S_HEADER = """\
# agentrt on Kubernetes{variant}: Redis (StatefulSet with a PersistentVolumeClaim), {workers} workers
# (StatefulSet: stable pod names are their --worker-id and, through the headless Service, their
# --advertise-url) and {routers} routers (Deployment behind the {router_service} Service, port {router_port}).
#   kubectl apply -k deploy/k8s/{dir}        (or: kubectl apply -f deploy/k8s/{dir}/agentrt.yaml)
# Probes: /health on every worker and router (503 while a worker drains). SIGTERM drains a worker
# within terminationGracePeriodSeconds; see docs/deploy.md, "Kubernetes".
# Rendered by deploy/render.py (with deploy/compose.yaml, from the same flags and env): edit that, then
#   python deploy/render.py
"""


def _labels(c: Cluster, component: str) -> dict[str, str]:
    return {"app": f"{c.name}-{component}", "app.kubernetes.io/name": f"{c.name}-{component}",
            "app.kubernetes.io/part-of": c.name, "app.kubernetes.io/component": component}


def _meta(c: Cluster, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "labels": _labels(c, component)}


def _http_probe(period_s: int, failures: int, timeout_s: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period_s,
            "timeoutSeconds": timeout_s, "failureThreshold": failures}


def _service(c: Cluster, name: str, component: str, port: int, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(c, name, component),
            "spec": {**spec, "selector": {"app": f"{c.name}-{component}"},
                     "ports": [{"name": "http" if component != "redis" else "redis", "port": port,
                                "targetPort": "http" if component != "redis" else "redis"}]}}


def _pdb(c: Cluster, component: str) -> dict[str, Any]:
    """At most one pod of the kind evicted at a time (a node drain drains one worker at a time)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(c, f"{c.name}-{component}", component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": f"{c.name}-{component}"}}}}


# Workers register in Redis as they start and exit if it does not answer; this waits for it first
# (the compose file's depends_on: service_healthy). redis-py is in the agentrt image.
WAIT_FOR_REDIS = """\
import os, time, redis
url = os.environ["AGENTRT_REDIS_URL"]
while True:
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
        break
    except (redis.RedisError, OSError) as exc:
        print(f"waiting for Redis at {url}: {exc}", flush=True)
        time.sleep(2)
"""


def k8s(c: Cluster) -> list[dict[str, Any]]:
    env_from = [{"configMapRef": {"name": c.config_map}}]
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(c, c.config_map, "config"),
              "data": agentrt_env(c, c.redis_service)}

    redis_svc = _service(c, c.redis_service, "redis", c.redis_port)
    ping = {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5, "timeoutSeconds": 3}
    redis_sts = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(c, c.redis_service, "redis"),
        "spec": {
            "serviceName": c.redis_service, "replicas": 1,
            "selector": {"matchLabels": {"app": f"{c.name}-redis"}},
            "template": {"metadata": {"labels": _labels(c, "redis")}, "spec": {
                "automountServiceAccountToken": False,
                "containers": [{
                    "name": "redis", "image": c.redis_image,
                    "command": ["redis-server", "--appendonly", "yes"],
                    "ports": [{"name": "redis", "containerPort": c.redis_port}],
                    "readinessProbe": {**ping, "failureThreshold": 2},
                    "livenessProbe": {**ping, "failureThreshold": 6},
                    "resources": c.redis_resources.k8s(),
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]}},
            # The only durable state (worker registry, KV events, sessions): on a volume that outlives
            # the pod, so a rescheduled Redis keeps its append-only file (an emptyDir would not).
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": c.redis_storage}}}}]}}

    # Workers: reached by routers at the URL they register, $(POD_NAME).<headless Service>; the Service
    # publishes not-ready pods too, so that name resolves while a worker starts and while it drains.
    worker_svc = _service(c, c.worker_service, "worker", c.worker_port, clusterIP="None",
                          publishNotReadyAddresses=True)
    worker_resources = c.worker_resources.k8s()
    worker_pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": c.worker_grace_s,
        "initContainers": [{"name": "wait-for-redis", "image": c.worker_image or c.image,
                            "imagePullPolicy": "IfNotPresent", "command": ["python", "-c", WAIT_FOR_REDIS],
                            "envFrom": env_from,
                            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                                          "limits": {"cpu": "200m", "memory": "128Mi"}}}],
        "containers": [{
            "name": "worker", "image": c.worker_image or c.image, "imagePullPolicy": "IfNotPresent",
            "command": worker_command(c, "$(POD_NAME)", f"http://$(POD_NAME).{c.worker_service}:{c.worker_port}"),
            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "envFrom": env_from,
            "ports": [{"name": "http", "containerPort": c.worker_port}],
            # The model loads before the port opens: up to 10 minutes before liveness starts.
            "startupProbe": _http_probe(5, 120),
            "readinessProbe": _http_probe(5, 2),
            "livenessProbe": _http_probe(10, 6, timeout_s=5),
            "resources": worker_resources}]}
    if c.worker_resources.gpus:  # GPU node pools are commonly tainted so that only GPU pods land there
        worker_pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    worker_sts = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(c, c.worker_service, "worker"),
        "spec": {"serviceName": c.worker_service, "replicas": c.workers, "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": f"{c.name}-worker"}},
                 "template": {"metadata": {"labels": _labels(c, "worker")}, "spec": worker_pod}}}

    router_svc = _service(c, c.router_service, "router", c.router_port, type="ClusterIP")
    router_deploy = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(c, c.router_service, "router"),
        "spec": {
            "replicas": c.routers,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": {"app": f"{c.name}-router"}},
            "template": {"metadata": {"labels": _labels(c, "router")}, "spec": {
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": c.router_grace_s,
                "containers": [{
                    "name": "router", "image": c.image, "imagePullPolicy": "IfNotPresent",
                    "command": router_command(c), "envFrom": env_from,
                    "ports": [{"name": "http", "containerPort": c.router_port}],
                    "startupProbe": _http_probe(2, 60),
                    "readinessProbe": _http_probe(5, 2),
                    "livenessProbe": _http_probe(10, 6, timeout_s=5),
                    # The Service's endpoints drop a terminating pod while SIGTERM is on its way: the
                    # pause lets them go before uvicorn stops accepting connections.
                    "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(c.router_pre_stop_s)]}}},
                    "resources": c.router_resources.k8s()}]}}}}

    return [config, redis_svc, redis_sts, worker_svc, worker_sts, _pdb(c, "worker"), router_svc, router_deploy,
            _pdb(c, "router")]


def kustomization(files: list[str]) -> dict[str, Any]:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": files}


# ------------------------------------------------------------ YAML


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, False)  # lists indented under their key


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


def _list(dumper: yaml.SafeDumper, items: list) -> yaml.Node:
    """Lists of short scalars on one line (commands, ports), as a hand-written compose file has them."""
    flow = bool(items) and all(isinstance(i, (str, int)) and "\n" not in str(i) for i in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


def _none(dumper: yaml.SafeDumper, _: None) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:null", "")


_Dumper.add_representer(str, _str)
_Dumper.add_representer(list, _list)
_Dumper.add_representer(type(None), _none)


def dump(*documents: Any, header: str = "", spaced: bool = False) -> str:
    """YAML of ``documents`` after ``header``; ``spaced``: a blank line between top-level entries and
    between the entries under them (a compose file's services)."""
    text = yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, width=110, default_flow_style=False,
                         explicit_start=len(documents) > 1)
    if spaced:
        lines: list[str] = []
        for line in text.splitlines():
            indent = len(line) - len(line.lstrip())
            if lines and indent <= 2 and not line.lstrip().startswith("- ") and \
                    len(lines[-1]) - len(lines[-1].lstrip()) > indent:
                lines.append("")
            lines.append(line)
        text = "\n".join(lines) + "\n"
    return header + text


# ------------------------------------------------------------ the files

CLUSTER = Cluster()
# One GPU per worker: a CUDA build of the image (Dockerfile's comment), --device cuda, a GPU-sized KV pool.
GPU_CLUSTER = dataclasses.replace(CLUSTER, worker_image="agentrt-cuda:latest", device="cuda", kv_cache_tokens=262144,
                                  worker_resources=Resources("4", "8", "16Gi", "16Gi", gpus=1))
VARIANTS = {"cpu": CLUSTER, "gpu": GPU_CLUSTER}


def render() -> dict[Path, str]:
    """Every rendered file's path (under deploy/) and text."""
    c = CLUSTER
    files = {
        DEPLOY / "compose.yaml": dump(compose(c), spaced=True, header=COMPOSE_HEADER.format(
            workers=c.workers, routers=c.routers,
            router_urls=" and ".join(f"http://localhost:{c.router_host_port + i}/v1 ({compose_router(i)})"
                                  for i in range(c.routers)))),
        DEPLOY / "prometheus" / "prometheus.yml": dump(prometheus(c), spaced=True, header=PROMETHEUS_HEADER),
    }
    for variant, v in VARIANTS.items():
        header = K8S_HEADER.format(variant=", one GPU per worker" if v.worker_resources.gpus else "",
                                   workers=v.workers, routers=v.routers, router_service=v.router_service,
                                   router_port=v.router_port, dir=variant)
        files[DEPLOY / "k8s" / variant / "agentrt.yaml"] = dump(*k8s(v), header=header)
        files[DEPLOY / "k8s" / variant / "kustomization.yaml"] = dump(
            kustomization(["agentrt.yaml"]), header="# kubectl apply -k deploy/k8s/" + variant + "\n"
            "# Rendered by deploy/render.py.\n")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare the committed files with a fresh render")
    args = parser.parse_args(argv)
    stale = []
    for path, text in render().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{'differs from a fresh render' if args.check else 'rendered'}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
