"""The deployment files rendered by ``deploy/render.py``: Kubernetes manifests (``deploy/k8s/{cpu,gpu}/``)
and the compose file, from one definition (docs/deploy.md, "Kubernetes").

* the committed files are a fresh render (so nobody edits one target and not the other);
* every Kubernetes document validates against the Kubernetes OpenAPI schemas (``kubernetes-validate``,
  strict: no unknown fields) of the oldest and a recent supported version;
* every agentrt command parses with the real ``agentrt`` parser and its settings validate with the real
  settings models, with the container's environment; compose and Kubernetes give the workers and the
  routers the same flags and the same settings, but for each target's worker identity and Redis host;
* every probe is a GET the real worker and router apps answer with 200 (a worker's with 503 once it
  drains), on the container port the process listens on;
* each pod's grace period outlasts the drain it gives its process (``--shutdown-timeout-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from engine.kv_move import KVLayout

from agentrt_cli import build_parser
from agentrt.config import ServerConfig
from router.config import RouterConfig, WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
VARIANTS = ("cpu", "gpu")
# The oldest Kubernetes these manifests are for, and a recent one (kubernetes-validate ships both).
K8S_VERSIONS = ("1.29", "1.35")


def _load_render():
    spec = importlib.util.spec_from_file_location("agentrt_deploy_render", DEPLOY / "render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


render = _load_render()


def bundle(variant: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / variant / "agentrt.yaml").read_text()) if d is not None]


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} documents"
    return found[0]


def selected(docs: list[dict[str, Any]], svc: dict[str, Any]) -> dict[str, Any]:
    """The one StatefulSet or Deployment whose pods the Service selects."""
    (target,) = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")
                 and svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    return target


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod_spec(doc)["containers"]
    return c


def agentrt_workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``worker`` and ``router``: the StatefulSet or Deployment whose container runs that command."""
    out = {}
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Deployment"):
            command = container(doc)["command"]
            if command[0] == "agentrt":
                assert command[1] not in out, f"two {command[1]} workloads"
                out[command[1]] = doc
    assert set(out) == {"worker", "router"}, set(out)
    return out


def container_env(docs: list[dict[str, Any]], c: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: its ConfigMaps' data, then ``env`` (here
    only literal values and the pod's name from the downward API)."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            env[var["name"]] = pod_name
    return env


def expand(command: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion in a command; every variable used must be defined."""
    def one(match: re.Match) -> str:
        assert match[1] in env, f"$({match[1]}) in the command is not in the container's env"
        return env[match[1]]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg) for arg in command]


def parse(command: list[str], env: dict[str, str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The command's flags as the real ``agentrt`` parser reads them, and the settings the process
    would run with (flags over ``env`` over defaults), validated by the real settings models."""
    assert command[0] == "agentrt", command
    parser = build_parser()
    try:
        args = parser.parse_args(command[1:])
    except SystemExit:
        pytest.fail(f"agentrt does not accept {command} (its error is above)")
    # argparse takes an unambiguous prefix of a flag too: the rendered flags must be whole ones
    (subcommands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = subcommands.choices[args.command]._option_string_actions
    partial = [arg.split("=")[0] for arg in command[2:] if arg.startswith("--") and arg.split("=")[0] not in options]
    assert not partial, f"agentrt {args.command} has no flag {partial} (only longer ones it abbreviates)"
    models = [ServerConfig, RouterConfig] + ([WorkerSettings] if args.command == "worker" else [])
    known = {cls.env_name(name) for cls in models for name in cls.model_fields}
    unknown = {k for k in env if k.startswith("AGENTRT_")} - known
    assert not unknown, f"{args.command}: no setting reads {sorted(unknown)}"
    settings = {cls.__name__: cls.from_args(args, env).model_dump() for cls in models}
    flags = {k: v for k, v in vars(args).items() if v is not None and not k.startswith("_")}
    return flags, settings


# ------------------------------------------------------------ rendered from one place


def _documents(text: str) -> list:
    return list(yaml.safe_load_all(text))


def test_committed_files_are_a_fresh_render():
    """Compared as YAML documents, not bytes: a PyYAML that lays out the same data differently is no drift."""
    rendered = render.render()
    stale = [str(p.relative_to(ROOT)) for p, text in rendered.items()
             if not p.exists() or _documents(p.read_text()) != _documents(text)]
    assert not stale, f"{stale} differ from a fresh render: edit deploy/render.py, then run python deploy/render.py"
    on_disk = {p for p in K8S.rglob("*") if p.is_file()}
    assert on_disk == {p for p in rendered if K8S in p.parents}, "deploy/k8s/ holds files render.py does not write"


@pytest.mark.parametrize("variant", VARIANTS)
def test_kustomization_builds_the_bundle(variant):
    kustomization = yaml.safe_load((K8S / variant / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["resources"] == ["agentrt.yaml"]
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (kubectl kustomize builds the kustomization)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / variant)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

    def key(d):
        return d["kind"], d["metadata"]["name"]

    assert sorted(yaml.safe_load_all(out.stdout), key=key) == sorted(bundle(variant), key=key)


# ------------------------------------------------------------ Kubernetes schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_document_validates_against_the_kubernetes_schemas(variant, version):
    docs = bundle(variant)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "PodDisruptionBudget", "Service", "Service",
                     "Service", "StatefulSet", "StatefulSet"]
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} (Kubernetes {version}): {where}: {exc.message}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_select_their_pods_and_ports(variant):
    docs = bundle(variant)
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    for svc in (d for d in docs if d["kind"] == "Service"):
        target = selected(docs, svc)
        ports = {p["name"] for p in container(target)["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, svc["metadata"]["name"]
    for w in workloads:
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        find(docs, "Service", sts["spec"]["serviceName"])


def test_gpu_variant_asks_each_worker_for_one_gpu():
    for variant, gpus in (("cpu", None), ("gpu", 1)):
        resources = container(agentrt_workloads(bundle(variant))["worker"])["resources"]
        assert resources["limits"].get("nvidia.com/gpu") == gpus, variant
        assert resources["requests"].get("nvidia.com/gpu") == gpus, variant
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind]), (variant, kind)
        worker = agentrt_workloads(bundle(variant))["worker"]
        _, settings = parse(expand(container(worker)["command"], {"POD_NAME": "agentrt-worker-0"}), {})
        assert settings["ServerConfig"]["device"] == ("cuda" if gpus else "cpu"), variant
    router = container(agentrt_workloads(bundle("gpu"))["router"])["resources"]
    assert "nvidia.com/gpu" not in router["limits"], "routers need no GPU"


# ------------------------------------------------------------ the same flags and env as compose


def test_every_command_parses_with_the_real_cli():
    for variant in VARIANTS:
        docs = bundle(variant)
        for role, doc in agentrt_workloads(docs).items():
            pod = f"{doc['metadata']['name']}-0"
            c = container(doc)
            env = container_env(docs, c, pod)
            parse(expand(c["command"], env), env)
    services = compose()["services"]
    for name, svc in services.items():
        if svc.get("command", [""])[0] == "agentrt":
            parse(svc["command"], {k: str(v) for k, v in svc.get("environment", {}).items()})


def test_compose_and_kubernetes_run_the_same_flags_and_env():
    docs = bundle("cpu")
    workloads = agentrt_workloads(docs)
    services = compose()["services"]
    c = render.CLUSTER
    for role, count, name in (("worker", c.workers, render.compose_worker),
                              ("router", c.routers, render.compose_router)):
        doc = workloads[role]
        assert doc["spec"]["replicas"] == count
        runs_role = {n for n, s in services.items() if s.get("command", [None, None])[:2] == ["agentrt", role]}
        assert runs_role == {name(i) for i in range(count)}
        for i in range(count):
            service = name(i)
            pod = f"{doc['metadata']['name']}-{i}"  # a StatefulSet's pod; a Deployment's name does not matter
            k8s_env = container_env(docs, container(doc), pod)
            k8s_flags, k8s_settings = parse(expand(container(doc)["command"], k8s_env), k8s_env)
            compose_env = {k: str(v) for k, v in services[service]["environment"].items()}
            compose_flags, compose_settings = parse(services[service]["command"], compose_env)

            # the AGENTRT_* variables: the same names, each target's Redis
            assert {k for k in k8s_env if k.startswith("AGENTRT_")} == set(compose_env), role
            compose_redis = compose_settings["RouterConfig"]["redis_url"]
            k8s_redis = k8s_settings["RouterConfig"]["redis_url"]
            assert compose_redis == f"redis://{render.COMPOSE_REDIS}:6379/0"
            host, port = re.fullmatch(r"redis://([^:/]+):(\d+)/0", k8s_redis).groups()
            redis_svc = find(docs, "Service", host)
            assert int(port) in {p["port"] for p in redis_svc["spec"]["ports"]}
            redis = container(selected(docs, redis_svc))
            assert redis["image"] == services[render.COMPOSE_REDIS]["image"]
            assert redis["command"] == services[render.COMPOSE_REDIS]["command"]

            # each target's worker identity: the compose service, the StatefulSet pod behind the headless Service
            if role == "worker":
                port = k8s_settings["ServerConfig"]["port"]
                assert compose_flags["worker_id"] == service
                assert compose_flags["advertise_url"] == f"http://{service}:{port}"
                headless = find(docs, "Service", doc["spec"]["serviceName"])
                assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
                assert k8s_flags["worker_id"] == pod
                assert k8s_flags["advertise_url"] == f"http://{pod}.{headless['metadata']['name']}:{port}"
                assert port in {p["port"] for p in headless["spec"]["ports"]}

            # everything else: the same flags given, the same settings
            identity = {"worker_id", "advertise_url"}
            assert {k: v for k, v in k8s_flags.items() if k not in identity} == \
                {k: v for k, v in compose_flags.items() if k not in identity}, role
            for model in compose_settings:
                mine, theirs = dict(k8s_settings[model]), dict(compose_settings[model])
                for field in identity | {"redis_url"}:
                    mine.pop(field, None), theirs.pop(field, None)
                assert mine == theirs, (role, model)


# ------------------------------------------------------------ probes and draining


class _StubTokenizer:
    vocab_size = 49152
    chat_template = None   # no template: the default parsers (Hermes, no reasoning)

    class hf:              # the `tokenizers` object: no control tokens (constrained calls in Hermes syntax)
        @staticmethod
        def get_added_tokens_decoder() -> dict:
            return {}


class _StubEngine:
    """Enough of engine.LLMEngine for the worker app to be built (no model, no step ever runs)."""

    def __init__(self, config, on_kv_event=None, kv_event_tokens=False):
        self.config = SimpleNamespace(page_size=RouterConfig().block_size, max_num_seqs=8, num_pages=64)
        self.tokenizer = _StubTokenizer()
        self.max_model_len = 2048
        self.model_id = "stub"
        self.scheduler = SimpleNamespace(pins={})
        self.tiers = None
        # what a page of its pool is, for the worker's KV moves (engine/kv_move.py); no page ever moves here
        self.mover = SimpleNamespace(layout=KVLayout("stub", "float32", (2, 30, 16, 3, 64), self.config.page_size,
                                                     30, 3, 64, "stub"))

    def has_unfinished(self) -> bool:
        return False

    def step(self) -> list:
        return []


@pytest.fixture(scope="module")
def apps():
    """The real worker and router apps (``create_worker_app``, ``create_router_app``) around a stub
    engine and tokenizer; their lifespans never run, so nothing connects to Redis."""
    import engine
    import router.model_info
    from router.app import create_router_app
    from router.model_info import RouterModel
    from router.worker import create_worker_app

    mp = pytest.MonkeyPatch()
    mp.setattr(engine, "LLMEngine", _StubEngine)
    mp.setattr(router.model_info, "load_router_model",
               lambda path, name=None, max_len=None: RouterModel(_StubTokenizer(), 2048, "stub"))
    unreachable = "redis://127.0.0.1:1/0"  # never used: lifespans do not run
    try:
        yield {"worker": create_worker_app(ServerConfig(), RouterConfig(redis_url=unreachable), WorkerSettings()),
               "router": create_router_app(ServerConfig(), RouterConfig(redis_url=unreachable))}
    finally:
        mp.undo()


def _probes(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in c.items() if k.endswith("Probe")}


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_get_routes_the_apps_serve_on_the_port_they_listen_on(variant, apps):
    docs = bundle(variant)
    for role, doc in agentrt_workloads(docs).items():
        c = container(doc)
        probes = _probes(c)
        assert {"readinessProbe", "livenessProbe"} <= set(probes), role
        env = container_env(docs, c, f"{doc['metadata']['name']}-0")
        _, settings = parse(expand(c["command"], env), env)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        client = TestClient(apps[role])
        for kind, probe in probes.items():
            get = probe["httpGet"]
            port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
            assert port == settings["ServerConfig"]["port"], f"{role} {kind} probes port {port}"
            resp = client.get(get["path"])
            assert resp.status_code == 200, f"{role} {kind}: GET {get['path']} answered {resp.status_code}"


@pytest.mark.slow
def test_a_draining_worker_fails_its_readiness_probe(apps):
    """``WorkerRuntime.drain`` (a worker's first SIGTERM) turns the probed path to 503."""
    app = apps["worker"]
    (path,) = {p["httpGet"]["path"] for p in _probes(container(agentrt_workloads(bundle("cpu"))["worker"])).values()}
    runtime = app.state.worker

    async def nothing() -> None:
        return None

    runtime._unregister = nothing  # no Redis here
    client = TestClient(app)
    assert client.get(path).status_code == 200
    try:
        asyncio.run(runtime.drain(app, 0.0))
        resp = client.get(path)
        assert resp.status_code == 503 and resp.json()["status"] == "stopping"
    finally:
        app.state.services.stopping = False
        app.state.services.generator.draining = False
        runtime._drain = None   # a worker drains once; the module's app serves the other tests


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)s", text)
    assert match, f"stop_grace_period {text!r}: expected seconds"
    return float(match[1])


def _pre_stop_s(c: dict[str, Any]) -> float:
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if command is None:
        return 0.0
    assert command[0] == "sleep", command
    return float(command[1])


# A worker's first SIGTERM drains it (router/worker.py: up to --shutdown-timeout-s for requests in
# flight), then uvicorn's graceful shutdown waits up to that again, then the engine's shutdown once
# more; a router has uvicorn's and its remote engine's. Past the grace period the process is killed.
SHUTDOWN_WAITS = {"worker": 3, "router": 2}


@pytest.mark.parametrize("variant", VARIANTS)
def test_grace_period_outlasts_the_drain(variant):
    docs = bundle(variant)
    for role, doc in agentrt_workloads(docs).items():
        c = container(doc)
        env = container_env(docs, c, f"{doc['metadata']['name']}-0")
        _, settings = parse(expand(c["command"], env), env)
        drain = settings["ServerConfig"]["shutdown_timeout_s"]
        needed = _pre_stop_s(c) + SHUTDOWN_WAITS[role] * drain
        grace = pod_spec(doc)["terminationGracePeriodSeconds"]
        assert grace > needed, f"{role}: grace period {grace}s, its shutdown may take {needed}s"
        if role == "router":
            assert _pre_stop_s(c) > 0, "a router must pause before it stops listening (its Service's endpoints)"
    for svc in compose()["services"].values():
        if svc.get("command", [""])[0] == "agentrt":
            env = {k: str(v) for k, v in svc["environment"].items()}
            _, settings = parse(svc["command"], env)
            needed = SHUTDOWN_WAITS[svc["command"][1]] * settings["ServerConfig"]["shutdown_timeout_s"]
            assert _seconds(svc["stop_grace_period"]) > needed, svc["command"]
