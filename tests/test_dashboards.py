"""The Grafana dashboard and the Prometheus rules of conf/: promtool checks them, and a
real Prometheus scraping a real `vega serve` evaluates every expression they hold."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.infra import require
from tests.models import window
from tests.servers import ROOT, VegaProcess, free_port, metric, wait_until
from vega.errors import REFUSALS, STATUS_BY_CODE
from vega.metrics import LATENCY_BUCKETS, Metrics
from vega.records import PRIORITY_NAMES

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py)

PROMETHEUS_CONF = ROOT / "conf" / "prometheus"
RULES = PROMETHEUS_CONF / "vega-rules.yml"
DASHBOARD = ROOT / "conf" / "grafana" / "vega.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

ROWS = ["Traffic and outcomes", "Refusals", "Queue", "Latency", "Batches",
        "Service rate and utilisation", "Overflow", "Redis and peers", "Processes", "Jobs"]

# Series a single `vega serve` without Redis exports all the same (the overflow and job
# counters at 0 from the start): only this expression may come back empty.
MAY_BE_EMPTY = {
    'priority="critical"': "the test sends no critical request, so none is refused",
}


def promtool(*args: str, cwd: Path = PROMETHEUS_CONF) -> subprocess.CompletedProcess[str]:
    require("promtool")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd,
                          check=False, timeout=60)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels_by_row(dash: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(row title, panel) for every panel that is not a row, collapsed rows' included."""
    found: list[tuple[str, dict[str, Any]]] = []
    row = ""
    for panel in dash["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            found += [(row, inner) for inner in panel.get("panels", [])]
        else:
            found.append((row, panel))
    return found


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for _, panel in panels_by_row(dash)]


def dashboard_expressions() -> list[tuple[str, str, str]]:
    """(row, where, PromQL) for each target and each variable query (its series selector)."""
    dash = dashboard()
    found = [(row, f"panel {p['title']!r} {t['refId']}", t["expr"])
             for row, p in panels_by_row(dash) for t in p["targets"]]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            selector = re.fullmatch(r"label_values\((.+), *\w+\)", var["definition"])
            assert selector is not None, var["definition"]
            found.append(("variables", f"variable {var['name']}", selector.group(1)))
    return found


def substitute(expr: str) -> str:
    """The query Grafana sends with every instance and every model selected."""
    query = expr.replace("$instance", ".*").replace("$model", ".*")
    assert "$" not in query, f"unsubstituted variable in {expr}"
    return query


def recorded_names() -> set[str]:
    return set(re.findall(r"^\s*- record: (\S+)$", RULES.read_text(), re.MULTILINE))


# -- promtool ------------------------------------------------------------------------


def test_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    rules = len(re.findall(r"^\s*- (?:record|alert): ", RULES.read_text(), re.MULTILINE))
    assert f"SUCCESS: {rules} rules found" in result.stdout, result.stdout


def test_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", "vega-rules.test.yml")
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_every_alert_has_unit_tests() -> None:
    alerts = set(re.findall(r"^\s*- alert: (\w+)$", RULES.read_text(), re.MULTILINE))
    tests = (PROMETHEUS_CONF / "vega-rules.test.yml").read_text()
    tested = re.findall(r"alertname: (\w+)\n\s+exp_alerts: *(\[\])?", tests)
    assert alerts and {name for name, quiet in tested if not quiet} == alerts  # each fires
    assert {name for name, quiet in tested if quiet} == alerts  # and each stays quiet


def test_the_latency_alert_threshold_is_a_bound_of_the_latency_histogram() -> None:
    # Between two bounds the p99 is interpolated: with none at the threshold, 3% of
    # answers a little over 0.5 s read as a p99 over 0.8 s.
    expr = re.search(r"alert: VegaLatencyNearDeadline\n\s+expr: (.+)", RULES.read_text())
    assert expr is not None and "request_seconds" in expr.group(1)
    assert float(expr.group(1).rpartition(">")[2]) in LATENCY_BUCKETS


def test_example_config_is_valid_and_loads_the_rules(tmp_path: Path) -> None:
    text = (PROMETHEUS_CONF / "prometheus.example.yml").read_text()
    assert "/etc/prometheus/vega-rules.yml" in text
    shutil.copy(RULES, tmp_path / "vega-rules.yml")
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace("/etc/prometheus/vega-rules.yml", "vega-rules.yml"))
    result = promtool("check", "config", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout, result.stdout


# -- the dashboard, read -------------------------------------------------------------


def test_dashboard_is_importable_with_a_datasource_variable() -> None:
    dash = dashboard()
    assert 39 <= dash["schemaVersion"] < 50 and dash["uid"] and dash["title"]
    assert [i["pluginId"] for i in dash["__inputs"]] == ["prometheus"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"datasource", "instance", "model"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "model"):
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"


def test_every_panel_reads_the_datasource_variable_and_has_a_target() -> None:
    dash = dashboard()
    found = panels(dash)
    assert len(found) >= len(ROWS)
    ids = [p["id"] for p in dash["panels"]] + [p["id"] for r in dash["panels"]
                                                for p in r.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in found:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']} has no target"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]


def test_dashboard_has_one_row_per_operator_question() -> None:
    rows = [p["title"] for p in dashboard()["panels"] if p["type"] == "row"]
    assert rows == ROWS


def test_dashboard_rates_come_from_recording_rules() -> None:
    recorded = recorded_names()
    rules = RULES.read_text()
    used: set[str] = set()
    for _, where, expr in dashboard_expressions():
        assert not re.search(r"\b(rate|irate|increase)\(", expr), f"{where}: {expr}"
        names = set(re.findall(r"\bvega:[\w:]+", expr))
        assert names <= recorded, f"{where} reads unrecorded {names - recorded}"
        used |= names
    # Each recorded series is shown, or read by another rule.
    for name in recorded - used:
        assert rules.count(name) > 1, f"{name} is recorded and never read"


def exported_names() -> set[str]:
    """The series names vega/metrics.py defines (counters with _total, histograms' parts)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    return {family.name + suffix for family in Metrics().registry.collect()
            for suffix in suffixes[family.type]}


def test_dashboard_and_rules_name_only_metrics_that_exist() -> None:
    """Every name the rules and panels read is one vega/metrics.py defines, and every
    overflow event they name is one the code counts."""
    text = RULES.read_text() + "\n".join(expr for _, _, expr in dashboard_expressions())
    named = set(re.findall(r"\bvega_\w+", text))
    assert named and not named - exported_names(), named - exported_names()
    sources = "".join(path.read_text() for path in (ROOT / "vega").rglob("*.py"))
    events = set(re.findall(r'event="(\w+)"', text))
    assert events and not [e for e in events if f'labels("{e}")' not in sources], events


def metric_labels() -> dict[str, set[str]]:
    """Label names of each series vega/metrics.py exports, and of each recorded one (its
    rule's ``by``), with those Prometheus adds (job, instance) and histograms' ``le``."""
    found: dict[str, set[str]] = {}
    metrics = Metrics()
    for family in metrics.registry.collect():
        collector = next(c for c in vars(metrics).values()
                         if getattr(c, "_name", getattr(c, "name", None)) == family.name)
        names = getattr(collector, "_labelnames", getattr(collector, "labelnames", ()))
        for suffix in ("", "_total", "_bucket", "_sum", "_count"):
            found[family.name + suffix] = {*names, "job", "instance", "le"}
    for name, by in re.findall(r"- record: (\S+)\n\s+expr: .*?by \(([^)]*)\)",
                               RULES.read_text()):
        found[name] = {label.strip() for label in by.split(",")}
    found["up"] = {"job", "instance"}
    return found


def test_dashboard_and_rules_use_only_labels_their_series_have() -> None:
    """A matcher, grouping or legend naming a label its series lack still evaluates, with
    data: ``model=~".*"`` matches a series with no model label, so a filter that filters
    nothing passes every other check. Each label named must be one the series read carry,
    and each outcome, reason, class and state value one the code gives."""
    labels = metric_labels()
    texts = [(f"rule {name}", expr) for name, expr in
             re.findall(r"- (?:record|alert): (\S+)\n\s+expr: (>-\n(?:\s{10,}.*\n)+|.*)",
                        RULES.read_text())]
    texts += [(where, expr) for _, where, expr in dashboard_expressions()]
    legends = {f"panel {p['title']!r} {t['refId']}": t.get("legendFormat", "")
               for p in panels(dashboard()) for t in p["targets"]}
    values = {"outcome": {"ok", "job", "disconnected", *STATUS_BY_CODE},
              "reason": set(REFUSALS), "priority": set(PRIORITY_NAMES),
              "state": {"queued", "pending"}, "direction": {"in", "out"}}
    failures = []
    for where, expr in texts:
        read = set(re.findall(r"\b(vega[_:][\w:]+|up)\b(?!\s*\()", expr))
        assert read and read <= set(labels), (where, read - set(labels))
        have = set.union(*(labels[name] for name in read))
        named = {label for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)
                 for label in re.split(r"\s*,\s*", group.strip()) if label}
        named |= set(re.findall(r"[{,]\s*(\w+)\s*[!=]~?", expr))
        named |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legends.get(where, "")))
        if named - have:
            failures.append(f"{where} names {named - have}, which {sorted(read)} lack")
        for label, value in re.findall(r"\b(\w+)\s*[!=]~?\s*\"([^\"]*)\"", expr):
            unknown = set(value.split("|")) - values.get(label, set(value.split("|")))
            if unknown:
                failures.append(f"{where}: {label} is never {unknown}")
    assert not failures, "\n".join(failures)


def test_latency_and_queue_wait_are_finer_than_the_loops_millisecond_clock(
        vega: Callable[..., VegaProcess]) -> None:
    # uvloop's loop.time() is whole milliseconds: timed by it, the histograms' first
    # buckets (0.5 and 1 ms) could not be told apart and each sum was whole ms.
    server = vega(VEGA_MODEL="python:tests.models:echo", VEGA_LENGTH_BUCKETS="16")
    body = orjson.dumps({"inputs": window(4)})
    for _ in range(5):
        assert httpx.post(server.url + "/v1/infer", content=body, timeout=10).status_code == 200
    for name in ("vega_request_seconds_sum", "vega_queue_wait_seconds_sum"):
        ms = 1000 * metric(server, name, model="echo")
        assert ms > 0 and abs(ms - round(ms)) > 1e-6, (name, ms)


def panel_query(title: str) -> str:
    """The one query of the panel titled ``title``, as Grafana sends it."""
    [expr] = [t["expr"] for p in panels(dashboard()) if p["title"] == title for t in p["targets"]]
    return substitute(expr)


def promql_over(tmp_path: Path, expr: str, series: dict[str, str],
                expected: dict[str, float]) -> None:
    """Evaluate ``expr`` with promtool over ``series`` (selector -> values every 15 s) at
    1 min, and check it gives ``expected`` (labels as PromQL writes them -> value)."""
    test = {
        "rule_files": [], "evaluation_interval": "15s",
        "tests": [{"interval": "15s",
                   "input_series": [{"series": s, "values": v} for s, v in series.items()],
                   "promql_expr_test": [{"expr": expr, "eval_time": "1m", "exp_samples": [
                       {"labels": labels, "value": value}
                       for labels, value in expected.items()]}]}]}
    (tmp_path / "panel.test.yml").write_text(json.dumps(test))  # JSON is YAML
    result = promtool("test", "rules", "panel.test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_jobs_by_state_counts_a_shared_redis_backlog_once(tmp_path: Path) -> None:
    # With Redis every process exports the shared stream's depth: two processes of job
    # "vega" both say 5 queued. Without Redis ("local") each holds its own jobs: 2 + 1.
    series = {
        'vega_redis_up{job="vega",instance="a:8001"}': "1x8",
        'vega_redis_up{job="vega",instance="b:8001"}': "1x8",
        'vega_redis_up{job="local",instance="c:8001"}': "0x8",
        'vega_redis_up{job="local",instance="d:8001"}': "0x8",
        'vega_jobs_depth{job="vega",instance="a:8001",model="m",state="queued"}': "5x8",
        'vega_jobs_depth{job="vega",instance="b:8001",model="m",state="queued"}': "5x8",
        'vega_jobs_depth{job="local",instance="c:8001",model="m",state="queued"}': "2x8",
        'vega_jobs_depth{job="local",instance="d:8001",model="m",state="queued"}': "1x8",
    }
    promql_over(tmp_path, panel_query("Jobs by state"), series, {'{state="queued"}': 8})


# -- a real Prometheus scraping a real server ----------------------------------------


class Prometheus:
    """``prometheus`` on a free port, scraping ``targets`` every second with Vega's rules."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.config = workdir / "prometheus.yml"
        self.config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "vega", "static_configs": [{"targets": targets}]}],
        }))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        with open(self.workdir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={self.config}",
                 f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, 30, "prometheus to be ready")
        return self

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: str) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(self.url + path, params=params, timeout=10).json()
        return body

    def query(self, expr: str) -> dict[str, Any]:
        return self.api("/api/v1/query", query=expr)

    def has_data(self, expr: str) -> bool:
        return bool(self.query(expr)["data"]["result"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def send_traffic(server: VegaProcess, seconds: float) -> dict[int, int]:
    """Valid windows (many refused by the tiny rate limit) and bad bodies (400, 422)."""
    statuses: dict[int, int] = {}
    end = time.monotonic() + seconds
    with httpx.Client(base_url=server.url, timeout=10) as client:
        while time.monotonic() < end:
            bodies = [orjson.dumps({"inputs": window(16)}),
                      orjson.dumps({"inputs": window(40), "priority": "sheddable"}),
                      orjson.dumps({"inputs": [[1.0, 2.0]]}), b"{not json"]
            for body in bodies:
                status = client.post("/v1/infer", content=body).status_code
                statuses[status] = statuses.get(status, 0) + 1
    return statuses


@pytest.fixture(scope="module")
def prometheus(vega_module: Callable[..., VegaProcess],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """One server and one Prometheus for the module: scraped before, during and after
    traffic, until the recorded rates have data."""
    require("prometheus")
    server = vega_module(VEGA_RATE_LIMIT="20", VEGA_REFUSAL_RATE="0")
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{server.port}"])
    prom.start()
    try:
        wait_until(lambda: prom.has_data('up{job="vega"} == 1'), 30, "a first scrape")
        statuses = send_traffic(server, 3.0)
        assert statuses.get(200) and statuses.get(429) and statuses.get(422), statuses
        wait_until(lambda: all(prom.has_data(e) for e in (
            'vega:requests:rate1m{outcome="ok"} > 0',
            'vega:rejections:rate1m{reason="rate_limited"} > 0',
            "vega:batches:rate1m > 0")), 30, "recorded rates of the traffic")
        yield prom
    finally:
        prom.stop()


def evaluate(prom: Prometheus, where: str, expr: str) -> str | None:
    """Why ``expr`` fails (an error, or no data where data is due), or None."""
    body = prom.query(expr)
    if body.get("status") != "success":
        return f"{where}: {body.get('errorType')}: {body.get('error')} in {expr}"
    if body["data"]["result"]:
        return None
    if any(name in expr for name in MAY_BE_EMPTY):
        return None
    return f"{where}: no data for {expr}"


def test_every_dashboard_expression_evaluates_with_data(prometheus: Prometheus) -> None:
    expressions = dashboard_expressions()
    failures = [why for _, where, expr in expressions
                if (why := evaluate(prometheus, where, substitute(expr)))]
    assert not failures, "\n".join(failures)
    # Only the critical refusals may be empty.
    allowed = {row for row, _, expr in expressions if any(n in expr for n in MAY_BE_EMPTY)}
    assert allowed == {"Refusals"}, allowed


def loaded_rules(prom: Prometheus) -> list[dict[str, Any]]:
    body = prom.api("/api/v1/rules")
    assert body["status"] == "success", body
    return [rule for group in body["data"]["groups"] for rule in group["rules"]]


def test_prometheus_loaded_every_rule_and_evaluates_it_healthy(prometheus: Prometheus) -> None:
    rules = loaded_rules(prometheus)
    names = {r["name"] for r in rules}
    text = RULES.read_text()
    assert names == set(re.findall(r"^\s*- (?:record|alert): (\S+)$", text, re.MULTILINE))
    for rule in rules:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
    alerts = {r["name"]: r["state"] for r in rules if r["type"] == "alerting"}
    assert alerts and set(alerts.values()) == {"inactive"}, alerts  # a healthy server


def test_every_recording_rule_returns_data(prometheus: Prometheus) -> None:
    recording = [r for r in loaded_rules(prometheus) if r["type"] == "recording"]
    failures = [why for rule in recording
                if (why := evaluate(prometheus, rule["name"], rule["query"]))]
    failures += [why for rule in recording
                 if (why := evaluate(prometheus, rule["name"] + " (recorded)", rule["name"]))]
    assert not failures, "\n".join(failures)


def test_every_alert_condition_evaluates_over_live_series(prometheus: Prometheus) -> None:
    """Each condition is false on a healthy server; made ``bool``, it shows the series it
    watches, so a misspelt metric cannot hide behind an alert that never fires."""
    alerting = [r for r in loaded_rules(prometheus) if r["type"] == "alerting"]
    failures = []
    for rule in alerting:
        body = prometheus.query(rule["query"])
        if body.get("status") != "success" or body["data"]["result"]:
            failures.append(f"{rule['name']}: {body} for a healthy server")
        watched = re.sub(r"(==|!=|>=|<=|>|<)\s*(?=[0-9.])", r"\1 bool ", rule["query"])
        assert " bool " in watched, rule["query"]
        if why := evaluate(prometheus, rule["name"] + " (bool)", watched):
            failures.append(why)
    assert not failures, "\n".join(failures)
