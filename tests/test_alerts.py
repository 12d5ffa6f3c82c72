"""The shipped Prometheus rules (deploy/prometheus/rules.yaml), tested for real:
promtool checks them, their unit tests (rules.test.yaml) pass and fail when an
alert is broken, every alert has its runbook section, every metric they name
exists, and a real Prometheus server scrapes a real `serve` and evaluates them
on what it scraped."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.parse
import urllib.request

import pytest
import yaml

from checkoutcache.serve.metrics import CATALOGUE, PROCESS_METRICS

from .helpers import Serve, free_port, wait_until

TOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RULES_DIR = os.path.join(TOP, "deploy", "prometheus")
RULES = os.path.join(RULES_DIR, "rules.yaml")
RULES_TEST = os.path.join(RULES_DIR, "rules.test.yaml")
RUNBOOK = os.path.join(TOP, "docs", "runbook.md")
DASHBOARD = os.path.join(TOP, "deploy", "grafana", "checkoutcache.json")
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
# What the issue asks alerts for: each one has a rule.
ALERTS = ("CheckoutcacheDiskWillFill", "CheckoutcacheDiskAlmostFull", "CheckoutcacheLimitUnmet",
          "CheckoutcacheCloneStuck", "CheckoutcacheCloneFailures", "CheckoutcacheReadyLatencyHigh",
          "CheckoutcacheSidecarNotReady")

pytestmark = pytest.mark.skipif(PROMTOOL is None or PROMETHEUS is None,
                                reason="Debian's prometheus package (promtool, prometheus) is not installed")


def rules() -> list[dict]:
    with open(RULES) as handle:
        return [rule for group in yaml.safe_load(handle)["groups"] for rule in group["rules"]]


def alerts() -> list[dict]:
    return [rule for rule in rules() if "alert" in rule]


def promtool(*args: str, cwd: str = RULES_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_finds_the_rules_valid():
    done = promtool("check", "rules", RULES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(rule["alert"] for rule in alerts()) == sorted(ALERTS)


@pytest.mark.slow
def test_each_alerts_unit_test_passes_and_fails_when_the_alert_is_broken(tmp_path):
    done = promtool("test", "rules", RULES_TEST)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(RULES_TEST) as handle:
        tested = {case["alertname"] for test in yaml.safe_load(handle)["tests"]
                  for case in test.get("alert_rule_test", [])}
    assert tested == set(ALERTS)
    # A rule that never fires makes its unit test fail: each test can fail.
    shutil.copy(RULES_TEST, tmp_path / "rules.test.yaml")
    for name in ALERTS:
        with open(RULES) as handle:
            document = yaml.safe_load(handle)
        for group in document["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == name:
                    rule["expr"] = "vector(1) > 2"
        with open(tmp_path / "rules.yaml", "w") as handle:
            yaml.safe_dump(document, handle)
        broken = promtool("test", "rules", "rules.test.yaml", cwd=str(tmp_path))
        assert broken.returncode != 0 and name in broken.stdout + broken.stderr, name


def exposed_names() -> set[str]:
    """Every series name serve exposes: histograms as their _bucket, _sum and _count."""
    names = {name for name, _kind, _help in PROCESS_METRICS}
    for spec in CATALOGUE:
        if spec.kind == "histogram":
            names |= {spec.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(spec.name)
    return names


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (strings, matchers, ranges and the
    label lists of by/on dropped first; then what is left that is not PromQL's own)."""
    expr = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]', " ", expr)
    expr = re.sub(r"\b(by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return words - {"histogram_quantile", "sum", "max", "min", "by", "rate", "on", "group_left", "and", "or",
                    "unless", "predict_linear", "max_over_time", "vector"}


def test_metric_names_reads_what_an_expression_reads():
    assert metric_names('sum by (job, le) (rate(a_bucket{x="y z"}[5m])) / on (job) group_left b:c') == \
        {"a_bucket", "b:c"}


def test_the_rules_name_only_metrics_serve_exposes_and_each_alert_has_its_runbook_section():
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    known = exposed_names() | recorded | {"up"}
    for rule in rules():
        metrics = metric_names(rule["expr"])
        assert metrics and metrics <= known, (rule.get("alert") or rule.get("record"), metrics - known)
    with open(RUNBOOK) as handle:
        runbook = handle.read()
    headings = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ +(.+?) *$",
                                                                                       runbook, re.M)}
    for rule in alerts():
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/runbook.md" and anchor == rule["alert"].lower() and anchor in headings, rule["alert"]
        section = runbook.split(f"## {rule['alert']}", 1)[1].split("\n## ", 1)[0]
        for part in ("What it means", "How to look", "What to do"):
            assert part in section, (rule["alert"], part)


def dashboard_queries() -> list[str]:
    with open(DASHBOARD) as handle:
        dashboard = json.load(handle)
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(queries) >= len(dashboard["panels"]) > 0
    # A variable's `label_values(SERIES, LABEL)`: the series is the query.
    variables = [re.fullmatch(r"label_values\((.+), *\w+\)", variable["query"]).group(1)
                 for variable in dashboard["templating"]["list"] if variable["type"] == "query"]
    return queries + variables


def test_the_dashboards_queries_name_metrics_that_exist():
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    known = exposed_names() | recorded
    for query in dashboard_queries():
        metrics = metric_names(query)
        assert metrics and metrics <= known, (query, metrics - known)


# ------------------------------------------------------------ a real Prometheus, a real serve

def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def prometheus_alerts(port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/alerts", timeout=10) as response:
        return json.load(response)["data"]["alerts"]


@pytest.mark.slow
def test_a_real_prometheus_scrapes_serve_and_evaluates_the_rules(root, tmp_path, upstream):
    health = free_port()
    # max-checkouts 0 with the default 15 minutes of grace: the scheduled gc (every second)
    # cannot meet it, and says so in checkoutcache_limit_unmet.
    running = Serve(root, tmp_path, "--allow-local", "--gc-interval", "1s", "--max-checkouts", "0",
                    "--health-listen", f"127.0.0.1:{health}")
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [RULES],
        "scrape_configs": [{"job_name": "checkoutcache", "static_configs": [{"targets": [f"127.0.0.1:{health}"]}]}],
    }))
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"],
                                  stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    try:
        def prometheus_ready() -> bool:
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/-/ready", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_until(prometheus_ready, 60, "Prometheus to be ready", interval=0.2)
        sha = upstream.shas[0]
        status, answer = running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": sha, "wait": 60})
        assert status == 200

        # Ready answers across several scrapes, until the recording rule has a p99 of them.
        def p99() -> float | None:
            for _ in range(20):
                running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": sha})
            found = query(web, "checkoutcache:ready_latency_seconds:p99_5m")
            values = [float(r["value"][1]) for r in found]
            return values[0] if values and values[0] == values[0] else None  # NaN until two scrapes saw a rate

        latency = wait_until(p99, 60, "the ready latency p99 to be recorded", interval=0.5)
        assert 0 < latency < 600
        (sample,) = query(web, "checkoutcache:ready_latency_seconds:p99_5m")
        assert sample["metric"] == {"__name__": "checkoutcache:ready_latency_seconds:p99_5m", "job": "checkoutcache",
                                    "instance": f"127.0.0.1:{health}"}

        # The store's ratio of free disk, recorded from what serve read from the root's filesystem.
        (ratio,) = wait_until(lambda: query(web, "checkoutcache:disk_free:ratio"), 30, "the disk ratio")
        stats = os.statvfs(root)
        assert abs(float(ratio["value"][1]) - stats.f_bavail / stats.f_blocks) < 0.05

        # The unmet limit, seen by the alert from real data: pending (it fires after 30 minutes).
        def unmet() -> list[dict]:
            return [a for a in prometheus_alerts(web) if a["labels"]["alertname"] == "CheckoutcacheLimitUnmet"]

        (alert,) = wait_until(unmet, 60, "CheckoutcacheLimitUnmet to be pending", interval=0.5)
        assert alert["state"] == "pending" and alert["labels"]["limit"] == "max-checkouts"
        assert alert["labels"]["instance"] == f"127.0.0.1:{health}"
        # A ready sidecar is not alerted on; its process metrics were scraped.
        assert not [a for a in prometheus_alerts(web) if a["labels"]["alertname"] == "CheckoutcacheSidecarNotReady"]
        assert query(web, "process_resident_memory_bytes")
        # Each of the dashboard's queries is PromQL this Prometheus runs (Grafana's variables filled in).
        for promql in dashboard_queries():
            query(web, promql.replace("$__rate_interval", "1m").replace("$instance", ".*"))
        assert float(query(web, "checkoutcache_checkouts")[0]["value"][1]) == 1
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(30)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait(10)
        running.stop()
