"""The Kubernetes manifests under deploy/kubernetes, offline: yamllint (strict, the repository's
.yamllint) on them and on the other YAML of the repository's deployment files; kubernetes-validate
(strict: unknown fields refused) of every core resource against the Kubernetes schemas it ships; the
ServiceMonitor and PrometheusRule (Prometheus Operator CRDs the Kubernetes schemas do not know) against
the parts of their CRDs they use, the rules being docker/alerts.yml's; and what must agree between the
files: selectors and labels, ports and probes, the drain time against the grace period, the image and its
user, and the settings against the server's flags."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from server.args import SERVE_FLAGS
from tests.docker.test_docker_files import DOCKER, env_of, instructions, interpolate, stages

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
# schemas kubernetes-validate ships: the oldest Kubernetes these manifests claim to work on, and its newest
K8S_VERSIONS = ("1.28.0", "latest")
CRD_KINDS = {("monitoring.coreos.com/v1", kind) for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule")}
# after the drain (--shutdown-timeout) the server stops the engine (up to 10 s, server.launch.serve_async) and
# lets the last error answers out (_DrainingServer.ABORT_FLUSH_S, 5 s): the grace period must cover both
STOP_MARGIN_S = 15
FLAGS_BY_ENV = {f.env: f for f in SERVE_FLAGS}


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(scope="module")
def resources() -> dict[str, dict[str, Any]]:
    """kind -> the one resource of that kind under deploy/kubernetes."""
    out: dict[str, dict[str, Any]] = {}
    for path in MANIFESTS:
        for doc in _documents(path):
            assert doc["kind"] not in out, f"a second {doc['kind']} in {path.name}"
            out[doc["kind"]] = doc
    assert {"Deployment", "Service", "ServiceMonitor", "PrometheusRule", "PodDisruptionBudget"} <= set(out)
    return out


def _container(resources: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers = resources["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


# ---------------------------------------------------------------- tools
def _tool(name: str) -> str | None:
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def test_yamllint() -> None:
    exe = _tool("yamllint")
    if exe is None:
        pytest.skip("yamllint not found: pip install yamllint (part of the project's test extras, so `make test` "
                    "installs it)")
    for path in K8S.rglob("*.y*ml"):
        assert "yamllint disable" not in path.read_text(), f"{path.name}: rules are not switched off here"
    targets = [str(K8S), str(DOCKER), str(ROOT / ".yamllint")]
    result = subprocess.run([exe, "--strict", "--format", "parsable", "-c", str(ROOT / ".yamllint"), *targets],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_validate(path: Path, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed: pip install "
                             "kubernetes-validate (part of the project's test extras, so `make test` installs it)")
    if version == "latest":
        version = kv.utils.latest_version()
    checked = 0
    for doc in _documents(path):
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # not in the Kubernetes schemas: test_service_monitor and test_prometheus_rule check them
        kv.validate(doc, version, strict=True)  # raises naming the field that is wrong
        checked += 1
    assert checked or all((d["apiVersion"], d["kind"]) in CRD_KINDS for d in _documents(path))


def test_kubernetes_validate_refuses_an_unknown_field(resources: dict[str, dict[str, Any]]) -> None:
    """The validator really reads the manifests strictly (a typo'd field is not silently accepted)."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    broken = json.loads(json.dumps(resources["Deployment"]))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kv.ValidationError, match="livenesProbe"):
        kv.validate(broken, kv.utils.latest_version(), strict=True)


# ---------------------------------------------------------------- the ServiceMonitor (a CRD)
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}


def _crd_schema(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus Operator resource (monitoring.coreos.com/v1) of `kind` whose spec is `spec`; anything
    else is refused so that a typo shows."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name"], "additionalProperties": False,
                         "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                        "labels": LABELS, "annotations": LABELS}},
            "spec": spec,
        },
    }


# the part of the ServiceMonitor CRD these manifests use, fields and patterns as the CRD states them
SERVICE_MONITOR_SCHEMA = _crd_schema("ServiceMonitor", {
    "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
    "properties": {
        "jobLabel": {"type": "string"},
        "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                     "properties": {"matchLabels": LABELS}},
        "namespaceSelector": {"type": "object"},
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["port", "path"], "additionalProperties": False,
            "properties": {
                "port": {"type": "string"},
                "path": {"type": "string"},
                "scheme": {"enum": ["http", "https"]},
                "interval": {"type": "string", "pattern": DURATION},
                "scrapeTimeout": {"type": "string", "pattern": DURATION},
                "honorLabels": {"type": "boolean"},
                "relabelings": {"type": "array"},
                "metricRelabelings": {"type": "array"},
            }}},
    },
})


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration))


def test_service_monitor(resources: dict[str, dict[str, Any]]) -> None:
    monitor, service = resources["ServiceMonitor"], resources["Service"]
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items(), "the monitor selects the Service by its labels"
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names, f"no Service port named {endpoint['port']}"
        assert endpoint["path"] == "/metrics"
        assert _seconds(endpoint["scrapeTimeout"]) < _seconds(endpoint["interval"])
    # `job` is the Service's name: the one docker/prometheus.yml gives, which the dashboard's job selector lists
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert service["metadata"]["name"] in {j["job_name"] for j in prometheus["scrape_configs"]}
    assert "jobLabel" not in monitor["spec"]


def test_service_monitor_schema_refuses_a_typo(resources: dict[str, dict[str, Any]]) -> None:
    broken = json.loads(json.dumps(resources["ServiceMonitor"]))
    broken["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)


# the part of the PrometheusRule CRD the rules use
PROMETHEUS_RULE_SCHEMA = _crd_schema("PrometheusRule", {
    "type": "object", "additionalProperties": False, "properties": {"groups": {
        "type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rules"], "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "interval": {"type": "string", "pattern": DURATION},
                "rules": {"type": "array", "items": {
                    "type": "object", "required": ["expr"], "additionalProperties": False,
                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                    "properties": {
                        "alert": {"type": "string"}, "record": {"type": "string"},
                        "expr": {"type": ["string", "integer"]},
                        "for": {"type": "string", "pattern": DURATION},
                        "keep_firing_for": {"type": "string", "pattern": DURATION},
                        "labels": LABELS, "annotations": LABELS,
                    }}},
            }}}},
})


def test_prometheus_rule(resources: dict[str, dict[str, Any]]) -> None:
    """The Operator's copy of the alerting rules is docker/alerts.yml's (which promtool checks and tests,
    tests/docker), labelled as the ServiceMonitor is."""
    rule = resources["PrometheusRule"]
    jsonschema.validate(rule, PROMETHEUS_RULE_SCHEMA)
    assert rule["spec"]["groups"] == yaml.safe_load((DOCKER / "alerts.yml").read_text())["groups"]
    assert rule["metadata"]["labels"] == resources["ServiceMonitor"]["metadata"]["labels"]


def test_prometheus_rule_schema_refuses_a_typo(resources: dict[str, dict[str, Any]]) -> None:
    broken = json.loads(json.dumps(resources["PrometheusRule"]))
    broken["spec"]["groups"][0]["rules"][0]["annotation"] = {}
    with pytest.raises(jsonschema.ValidationError, match="annotation"):
        jsonschema.validate(broken, PROMETHEUS_RULE_SCHEMA)


# ---------------------------------------------------------------- cross-checks
def test_selectors_match_the_pods(resources: dict[str, dict[str, Any]]) -> None:
    deployment = resources["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert resources["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert resources["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # several pods behind the Service, replaced one by one without dropping below the count
    assert deployment["spec"]["replicas"] >= 2
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
    assert resources["PodDisruptionBudget"]["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


def test_ports_and_probes(resources: dict[str, dict[str, Any]]) -> None:
    container = _container(resources)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = _env(container)
    image_env = env_of(stages(DOCKER / "Dockerfile")[-1])
    port = int(env.get("MLASERVE_PORT", image_env["MLASERVE_PORT"]))
    assert ports == {"http": port}, "one container port, the one the server listens on"
    assert env.get("MLASERVE_HOST", image_env["MLASERVE_HOST"]) == "0.0.0.0", "reachable from the kubelet"
    for sp in resources["Service"]["spec"]["ports"]:
        assert ports.get(sp["targetPort"], sp["targetPort"]) == port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]["httpGet"]
        assert probe["path"] == "/health", kind
        assert ports.get(probe["port"], probe["port"]) == port, kind
        assert container[kind]["timeoutSeconds"] < container[kind]["periodSeconds"], kind
    # loading: the startup probe waits at least as long as the image's HEALTHCHECK start period
    start = container["startupProbe"]
    healthcheck = next(a for w, a in instructions(DOCKER / "Dockerfile") if w == "HEALTHCHECK")
    start_period = _seconds(re.search(r"--start-period=(\S+)", healthcheck).group(1))
    assert start["periodSeconds"] * start["failureThreshold"] >= start_period
    # a dead engine is restarted, a slow moment is not
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30


def _shutdown_timeout(container: dict[str, Any]) -> float:
    """--shutdown-timeout as the container sets it: its args beat its env, which beats the flag's default."""
    flag = FLAGS_BY_ENV["MLASERVE_SHUTDOWN_TIMEOUT"]
    args = container.get("args", [])
    for i, a in enumerate(args):
        if a == "--shutdown-timeout":
            return flag.parse(args[i + 1])
        if a.startswith("--shutdown-timeout="):
            return flag.parse(a.split("=", 1)[1])
    value = _env(container).get(flag.env)
    return flag.parse(value) if value is not None else flag.default


def test_the_grace_period_covers_the_drain(resources: dict[str, dict[str, Any]]) -> None:
    pod = resources["Deployment"]["spec"]["template"]["spec"]
    container = _container(resources)
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    sleep = 0.0
    if "exec" in pre_stop:
        command = pre_stop["exec"]["command"]
        assert command[0] == "sleep" and len(command) == 2, command
        sleep = float(command[1])
    elif "sleep" in pre_stop:
        sleep = float(pre_stop["sleep"]["seconds"])
    timeout = _shutdown_timeout(container)
    assert timeout > 0
    assert pod["terminationGracePeriodSeconds"] > sleep + timeout + STOP_MARGIN_S, (
        f"SIGKILL would cut the drain: {pod['terminationGracePeriodSeconds']} s <= preStop {sleep} s + "
        f"--shutdown-timeout {timeout} s + {STOP_MARGIN_S} s to stop the engine")


def test_image_user_and_resources(resources: dict[str, dict[str, Any]]) -> None:
    container = _container(resources)
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    service = compose["services"]["mlaserve"]
    assert interpolate(service["build"]["dockerfile"]) == "docker/Dockerfile"
    assert container["image"] == service["image"], "the image compose builds from docker/Dockerfile"
    assert container["imagePullPolicy"] == "IfNotPresent", "a :latest tag would otherwise always be pulled"
    user = next(a for w, a in reversed(stages(DOCKER / "Dockerfile")[-1]) if w == "USER")
    uid, gid = (int(x) for x in user.split(":"))
    pod_security = resources["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert (pod_security["runAsUser"], pod_security["runAsGroup"]) == (uid, gid) and pod_security["runAsNonRoot"]
    requests = container["resources"]["requests"]
    assert {"cpu", "memory"} <= set(requests)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}

    def memory(q: str) -> int:
        m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", q)
        assert m, q
        return int(m.group(1)) * units[m.group(2)]
    assert memory(container["resources"]["limits"]["memory"]) >= memory(requests["memory"])


def test_settings_are_valid_flags(resources: dict[str, dict[str, Any]]) -> None:
    """Every MLASERVE_* the container sets is a `mlaserve serve` variable with a value its flag accepts."""
    container = _container(resources)
    for item in container.get("env", []):
        flag = FLAGS_BY_ENV.get(item["name"])
        assert flag is not None, f"{item['name']} is not a variable of `mlaserve serve`"
        if "value" in item:
            flag.parse(item["value"])  # raises saying what is wrong
        else:
            assert item["valueFrom"]["secretKeyRef"].get("optional") is True, f"{item['name']}: a required Secret"
    assert not container.get("command"), "the image's ENTRYPOINT (mlaserve serve) runs"


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def test_kustomize_renders_the_same_resources(resources: dict[str, dict[str, Any]]) -> None:
    """`kubectl apply -k deploy/kubernetes` applies what the files say (kustomize runs offline)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: the kustomize rendering is not checked (the files are, above)")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rendered = {d["kind"]: d for d in yaml.safe_load_all(result.stdout) if d}
    assert rendered == resources
