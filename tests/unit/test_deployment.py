"""The deployment files against the code: they cannot run here (no Docker engine),
so every name they use is checked to exist.

* ``docker-compose.yml``: the services; every ``kafka-idem`` command parses with the
  real click CLI and its ``MODULE:APP`` imports to a kafka_idem App; every
  ``KAFKA_IDEM_*`` variable is a setting (and its value loads); the topics step
  creates the app's topics; the payments service is a scalable group whose
  /metrics is reachable and scraped.
* ``Dockerfile``: builds the wheel in a first stage and installs it in the runtime;
  copies what exists, where the example expects it.
* ``deploy/prometheus.yml``, ``deploy/alerts.yml`` and the Grafana dashboard: every
  PromQL expression parses (promql-parser) and uses only metric names and labels
  that :class:`kafka_idem.observe.metrics.Metrics` exports; the dashboard shows them all,
  except the deprecated ones, which nothing in deploy/ uses.
* ``deploy/kubernetes/payments.yaml``: its commands and settings as for compose; its
  liveness and readiness probes are ``/livez`` and ``/readyz`` on the metrics port.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import psycopg
import pytest
import yaml
from click.testing import CliRunner
from prometheus_client.metrics import MetricWrapperBase

from kafka_idem import App
from kafka_idem.cli.commands import cli
from kafka_idem.cli.common import load_app
from kafka_idem.observe.metrics import OUTCOMES, Metrics
from kafka_idem.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kafka_idem.json"
KUBERNETES = ROOT / "deploy" / "kubernetes" / "payments.yaml"
# Kept one release for compatibility; dashboards and alerts must not use them.
DEPRECATED = {"kafka_idem_duplicate_ratio"}
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"

PREFIX = "KAFKA_IDEM_"
# Labels Prometheus adds to every scraped series (deploy/prometheus.yml adds `group`).
TARGET_LABELS = {"job", "instance", "group"}
# Grafana's variables, replaced by sample values before parsing.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


# --- loading ------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    return dict(compose()["services"])


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


def interpolate(value: str) -> str:
    """Compose variable interpolation with an empty environment (defaults apply)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(2) in (":-", "-"):
            return m.group(3)
        if m.group(2) in (":?", "?"):
            raise AssertionError(f"{m.group(0)} requires a variable with no default")
        return ""

    return _VAR.sub(sub, value)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    out = {}
    for name, val in env.items():
        # Compose rejects YAML booleans here ("true" must be quoted).
        assert not isinstance(val, bool), f"{name}: quote the boolean {val!r}"
        out[name] = interpolate("" if val is None else str(val))
    return out


def argv(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(interpolate(value))
    return [interpolate(str(v)) for v in value]


def shell_lines(service: dict[str, Any]) -> list[list[str]]:
    """The command lines a service runs: its exec form, or the lines of a ``sh -c`` script."""
    line = argv(service.get("entrypoint")) + argv(service.get("command"))
    if len(line) >= 2 and Path(line[0]).name in ("sh", "bash") and line[1].startswith("-") \
            and "c" in line[1]:
        script = line[2] if len(line) > 2 else ""
        parts = re.split(r"\n|&&|;|\|\|", script)
        return [shlex.split(p) for p in parts if p.strip()]
    return [line] if line else []


def kafka_idem_lines() -> Iterator[tuple[str, list[str]]]:
    for name, svc in services().items():
        for line in shell_lines(svc):
            if line and Path(line[0]).name == "kafka-idem":
                yield name, line


def metrics_port(svc: dict[str, Any]) -> int:
    for line in shell_lines(svc):
        if "--metrics-port" in line:
            return int(line[line.index("--metrics-port") + 1])
    return int(environment(svc)[f"{PREFIX}METRICS_PORT"])


# --- the CLI, without running anything ----------------------------------------------------


def parse_cli(line: list[str]) -> click.Context:
    """Parse ``kafka-idem ...`` with the real click commands (unknown command or option,
    missing argument or bad value: click.UsageError). Nothing is invoked."""
    group: click.Command = cli
    ctx = click.Context(cli, info_name="kafka-idem")
    args = list(line[1:])
    while isinstance(group, click.Group):
        opts = {o: p for p in group.params for o in (*p.opts, *p.secondary_opts)}
        while args and args[0].startswith("-"):
            name = args[0].split("=", 1)[0]
            assert name in opts, f"kafka-idem: no global option {name} in {line}"
            param = opts[name]
            takes_value = "=" not in args[0] and not getattr(param, "is_flag", False)
            args = args[2:] if takes_value else args[1:]
        assert args, f"no command in {line}"
        sub = group.get_command(ctx, args[0])
        assert sub is not None, f"kafka-idem has no command {args[0]!r} ({line})"
        ctx = click.Context(sub, info_name=args[0], parent=ctx)
        group, args = sub, args[1:]
    return group.make_context(ctx.info_name, args, parent=ctx.parent)


def app_specs(ctx: click.Context) -> list[str]:
    return [v for k, v in ctx.params.items() if k == "app_spec" and v]


# --- metrics ----------------------------------------------------------------------------


def exported() -> dict[str, set[str]]:
    """Every sample name /metrics can carry -> its label names."""
    metrics = Metrics()
    labels: dict[str, tuple[str, ...]] = {}
    for wrapper in vars(metrics).values():
        if isinstance(wrapper, MetricWrapperBase):
            labels[wrapper._name] = tuple(wrapper._labelnames)
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        base = set(labels[family.name])
        suffixes = {"counter": ["_total", "_created"], "gauge": [""],
                    "histogram": ["_bucket", "_count", "_sum", "_created"],
                    "summary": ["", "_count", "_sum", "_created"]}[family.type]
        for suffix in suffixes:
            names[family.name + suffix] = base | ({"le"} if suffix == "_bucket" else set())
    return names


def promql(expr: str) -> Any:
    import promql_parser  # dev dependency: promql-parser

    for var, sample in GRAFANA_VARS.items():
        expr = expr.replace(var, sample)
    try:
        return promql_parser.parse(expr)
    except ValueError as exc:
        raise AssertionError(f"PromQL does not parse: {expr!r}: {exc}") from exc


def check_expr(expr: str, names: dict[str, set[str]], where: str) -> set[str]:
    """Parse ``expr``; fail on an unknown kafka_idem metric, a label a selector matches or an
    aggregation groups by that its metrics do not have. Return the metric names used."""
    import promql_parser as pp

    used: set[str] = set()

    def labels_of(node: Any) -> set[str]:
        if node is None or isinstance(node, pp.NumberLiteral | pp.StringLiteral):
            return set()
        if isinstance(node, pp.MatrixSelector):
            return labels_of(node.vector_selector)
        if isinstance(node, pp.VectorSelector):
            name = node.name
            assert name, f"{where}: a selector without a metric name: {expr}"
            if name == "up" or not name.startswith("kafka_idem_"):
                assert name == "up", f"{where}: unexpected metric {name!r} in {expr}"
                have = set(TARGET_LABELS)
            else:
                assert name in names, f"{where}: {name} is not exported by Metrics(): {expr}"
                used.add(name)
                have = names[name] | TARGET_LABELS
            for m in node.matchers.matchers:
                assert m.name in have, f"{where}: {name} has no label {m.name!r}: {expr}"
            return have
        if isinstance(node, pp.AggregateExpr):
            inner = labels_of(node.expr) | labels_of(node.param)
            mod = node.modifier
            if mod is None:
                return set()
            missing = set(mod.labels) - inner
            assert not missing, f"{where}: grouping by unknown labels {missing}: {expr}"
            return set(mod.labels) if mod.type == pp.AggModifierType.By else inner - set(
                mod.labels)
        if isinstance(node, pp.Call):
            return set().union(*(labels_of(a) for a in node.args))
        if isinstance(node, pp.BinaryExpr):
            lhs, rhs = labels_of(node.lhs), labels_of(node.rhs)
            if node.modifier is not None and node.modifier.matching is not None:
                missing = set(node.modifier.matching.labels) - (lhs | rhs)
                assert not missing, f"{where}: matching on unknown labels {missing}: {expr}"
            return lhs | rhs
        if isinstance(node, pp.ParenExpr | pp.UnaryExpr | pp.SubqueryExpr):
            return labels_of(node.expr)
        raise AssertionError(f"{where}: unexpected PromQL node {type(node).__name__}")

    labels_of(promql(expr))
    return used


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for p in panels(dashboard()["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r}", t["expr"]))
    return out


# --- docker-compose.yml: services and commands ------------------------------------------


def test_compose_has_the_services() -> None:
    assert {"kafka", "postgres", "migrate", "topics", "payments", "prometheus"} <= set(
        services())


def test_every_kafka_idem_command_is_a_real_command_of_a_real_app() -> None:
    seen = set()
    for service, line in kafka_idem_lines():
        try:
            ctx = parse_cli(line)
        except click.UsageError as exc:
            raise AssertionError(f"{service}: {shlex.join(line)}: {exc.format_message()}") \
                from exc
        seen.add((service, ctx.info_name))
        for spec in app_specs(ctx):
            app = load_app(spec)  # imports MODULE, checks it is a kafka_idem App
            assert isinstance(app, App) and app.handlers, f"{service}: {spec} has no handlers"
    assert {("migrate", "migrate"), ("payments", "run")} <= seen, seen
    # The migrate step also creates the example's own tables.
    (migrate,) = [line for s, line in kafka_idem_lines() if s == "migrate"]
    assert app_specs(parse_cli(migrate)) == ["consumers.payments:app"]


def test_parse_cli_rejects_what_kafka_idem_would_reject() -> None:
    """The checker itself: a wrong command, option or missing argument is caught."""
    for bad in (["kafka-idem", "runn", "x:y"], ["kafka-idem", "run", "m:a", "--metric-port", "1"],
                ["kafka-idem", "run"], ["kafka-idem", "--nope", "run", "m:a"],
                ["kafka-idem", "run", "m:a", "--metrics-port", "ninety"]):
        with pytest.raises((click.UsageError, AssertionError)):
            parse_cli(bad)
    assert parse_cli(["kafka-idem", "--log-format", "json", "run", "m:a"]).params["app_spec"] \
        == "m:a"


def known_variables() -> set[str]:
    """Settings fields as KAFKA_IDEM_ names, plus the variables the code reads itself."""
    names = {f"{PREFIX}{field.upper()}" for field in Settings.model_fields}
    pattern = re.compile(r"environ(?:\.get)?[\[(]\s*[\"'](KAFKA_IDEM_[A-Z0-9_]+)")
    for path in (ROOT / "kafka_idem").rglob("*.py"):
        names |= set(pattern.findall(path.read_text()))
    return names


def test_every_kafka_idem_variable_is_a_setting() -> None:
    known = known_variables()
    assert f"{PREFIX}ACTOR" in known  # read by kafka_idem.admin.audit, not a Settings field
    used = {(svc, name) for svc, s in services().items() for name in environment(s)
            if name.startswith(PREFIX)}
    used |= {("Dockerfile", m) for m in re.findall(r"\b(KAFKA_IDEM_[A-Z0-9_]+)=",
                                                   DOCKERFILE.read_text())}
    assert used, "docker-compose.yml configures nothing?"
    unknown = sorted(f"{svc}: {name}" for svc, name in used if name not in known)
    assert not unknown, f"not settings of kafka_idem.settings.Settings: {unknown}"


def test_every_service_environment_loads_as_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values too: each service's KAFKA_IDEM_* variables load without a ConfigError."""
    for svc, s in services().items():
        env = {k: v for k, v in environment(s).items() if k.startswith(PREFIX)}
        if not env:
            continue
        with monkeypatch.context() as mp:
            for name in [n for n in os.environ if n.startswith(PREFIX)]:
                mp.delenv(name)
            for k, v in env.items():
                mp.setenv(k, v)
            settings = load_settings()
        assert settings.bootstrap_servers == "kafka:9092", svc
        assert settings.log_format == "json", svc


def test_a_bad_metrics_address_fails_at_start_up_naming_the_setting() -> None:
    from kafka_idem.errors import ConfigError

    assert load_settings(metrics_addr="0.0.0.0").model_dump()["metrics_addr"] == "0.0.0.0"
    assert load_settings().model_dump()["metrics_addr"] == "127.0.0.1"  # not exposed by default
    with pytest.raises(ConfigError, match=f"{PREFIX}METRICS_ADDR"):
        load_settings(metrics_addr="every-interface")


def test_database_url_points_at_the_postgres_service() -> None:
    svcs = services()
    pg = environment(svcs["postgres"])
    for name in ("migrate", "payments"):
        info = psycopg.conninfo.conninfo_to_dict(environment(svcs[name])[f"{PREFIX}DATABASE_URL"])
        assert info["host"] == "postgres" and info.get("port", "5432") == "5432", name
        assert info["user"] == pg["POSTGRES_USER"], name
        assert info["password"] == pg["POSTGRES_PASSWORD"], name
        assert info["dbname"] == pg["POSTGRES_DB"], name


def test_kafka_is_one_kraft_node_without_auto_create() -> None:
    kafka = services()["kafka"]
    env = environment(kafka)
    assert kafka["image"] == "apache/kafka:4.1.1"
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"].startswith(f"{env['KAFKA_NODE_ID']}@")
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] in env["KAFKA_LISTENERS"]
    for name in ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
                 "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
                 "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"):
        assert env[name] == "1", name
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    # The apps' bootstrap address is one the broker advertises.
    advertised = {a.split("://", 1)[1] for a in env["KAFKA_ADVERTISED_LISTENERS"].split(",")}
    for name in ("migrate", "payments"):
        boot = environment(services()[name]).get(f"{PREFIX}BOOTSTRAP_SERVERS")
        if boot:
            assert set(boot.split(",")) <= advertised, (name, boot, advertised)
    assert kafka.get("healthcheck"), "topics and payments wait for a healthy broker"


def test_one_shot_steps_wait_for_healthy_services() -> None:
    svcs = services()
    assert svcs["postgres"].get("healthcheck")
    assert svcs["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert svcs["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in ("migrate", "topics"):
        assert str(svcs[name].get("restart", "no")) == "no", name


def test_topics_step_creates_the_apps_topics_and_dlqs() -> None:
    from kafka_idem.cli.commands import cli

    svc = services()["topics"]
    command = [str(c) for c in svc["command"]]
    assert command[:3] == ["kafka-idem", "topics", "create"], command
    assert "create" in cli.commands["topics"].commands  # type: ignore[attr-defined]
    # the same app as the members, so its topics are the ones they subscribe to
    run = [str(c) for c in services()["payments"]["command"]]
    assert command[3] == run[run.index("run") + 1] == "consumers.payments:app"
    replicas = services()["payments"]["deploy"]["replicas"]
    assert int(command[command.index("--partitions") + 1]) >= replicas, "a partition each"
    assert environment(svc)[f"{PREFIX}BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert svc["image"] == services()["payments"]["image"]


def test_payments_is_a_scalable_gracefully_stopping_group() -> None:
    svc = services()["payments"]
    assert "container_name" not in svc, "a fixed name forbids --scale"
    assert not svc.get("ports"), "a published host port forbids --scale (use expose)"
    assert svc["deploy"]["replicas"] >= 2
    assert svc["stop_signal"] == "SIGTERM"
    grace = re.fullmatch(r"(\d+)(s|m)", str(svc["stop_grace_period"]))
    assert grace, svc["stop_grace_period"]
    assert int(grace[1]) * (60 if grace[2] == "m" else 1) >= 10
    deps = svc["depends_on"]
    assert deps["migrate"]["condition"] == "service_completed_successfully"
    assert deps["topics"]["condition"] == "service_completed_successfully"
    assert str(metrics_port(svc)) in [str(p) for p in svc.get("expose", [])]
    assert svc["build"] == "." and DOCKERFILE.exists()


def test_payments_service_runs_the_app_with_a_reachable_metrics_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The payments service's exact command and environment through the real CLI, with
    the Runner replaced: the app loads, settings come from the compose variables, and
    /metrics binds all interfaces on the scraped port (Prometheus is another container)."""
    import os

    import consumers.payments
    import kafka_idem.consume.runner

    svc = services()["payments"]
    (line,) = [line for s, line in kafka_idem_lines() if s == "payments"]
    for name in [n for n in os.environ if n.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    for k, v in environment(svc).items():
        monkeypatch.setenv(k, v)
    # The module-level app caches its settings: load them afresh from this environment
    # (restored after the test).
    monkeypatch.setattr(consumers.payments.app, "_settings", None)
    calls: dict[str, Any] = {}

    class FakeMetrics:
        def serve(self, port: int, addr: str = "127.0.0.1") -> int:
            calls["serve"] = (port, addr)
            return port

    class FakeRunner:
        def __init__(self, app: App, **_kw: Any) -> None:
            calls["settings"] = app.settings
            self.metrics = FakeMetrics()

        def install_signal_handlers(self) -> None:
            calls["signals"] = True

        def run(self, **_kw: Any) -> int:
            return 0

    monkeypatch.setattr(kafka_idem.consume.runner, "Runner", FakeRunner)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        result = CliRunner().invoke(cli, line[1:], catch_exceptions=False)
    finally:
        root.handlers[:], root.level = handlers, level
    assert result.exit_code == 0, result.output
    settings: Settings = calls["settings"]
    assert settings.bootstrap_servers == "kafka:9092"
    assert settings.log_format == "json"
    assert psycopg.conninfo.conninfo_to_dict(settings.dsn)["host"] == "postgres"
    assert calls["signals"]
    assert calls["serve"] == (metrics_port(svc), "0.0.0.0")


# --- Prometheus ---------------------------------------------------------------------------


def mounts(service: str) -> dict[str, Path]:
    """Container path -> repository path of a service's bind mounts."""
    out = {}
    for vol in services()[service].get("volumes", []):
        if isinstance(vol, str) and vol.startswith("./"):
            src, dst = vol.split(":")[:2]
            out[dst] = ROOT / src
    return out


def test_bind_mounts_exist() -> None:
    for name in services():
        for dst, src in mounts(name).items():
            assert src.exists(), f"{name}: {src} (mounted at {dst}) is missing"


def test_prometheus_scrapes_every_payments_replica_on_its_metrics_port() -> None:
    files = mounts("prometheus")
    assert files["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    config = yaml.safe_load(PROMETHEUS.read_text())
    port = metrics_port(services()["payments"])
    found = [
        sd for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", [])
        if "payments" in sd["names"]
    ]
    assert found, "no DNS service discovery of the payments service"
    for sd in found:
        assert sd.get("type", "SRV") == "A", "Docker DNS answers A records, one per replica"
        assert sd["port"] == port
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["kafka_idem"].get("metrics_path", "/metrics") == "/metrics"
    for rule_file in config.get("rule_files", []):
        assert rule_file in files, f"{rule_file} is not mounted into prometheus"


def test_alert_rules_parse_and_use_exported_metrics() -> None:
    names = exported()
    rules = yaml.safe_load(ALERTS.read_text())
    seen = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            seen |= check_expr(rule["expr"], names, f"alert {rule['alert']}")
            assert rule["labels"]["severity"] in ("warning", "critical")
    assert {"kafka_idem_messages_total", "kafka_idem_dlq_produce_failures_total",
            "kafka_idem_consumer_lag_messages", "kafka_idem_exhausted_total"} <= seen


# --- Grafana --------------------------------------------------------------------------------


def test_dashboard_queries_parse_and_use_exported_metrics_and_labels() -> None:
    names = exported()
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    for where, expr in exprs:
        check_expr(expr, names, where)
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert m, query
        check_expr(f"count by ({m[2]}) ({m[1]})", names, f"variable {var['name']}")


def test_dashboard_shows_every_exported_metric() -> None:
    names = exported()
    shown = set()
    for where, expr in dashboard_exprs():
        shown |= check_expr(expr, names, where)
    families = {f.name for f in Metrics().registry.collect()} - DEPRECATED
    missing = {f for f in families if not any(s.startswith(f) for s in shown)}
    assert not missing, f"metrics not on the dashboard: {sorted(missing)}"


def test_nothing_in_deploy_uses_a_deprecated_metric() -> None:
    names = exported()
    used = set()
    for where, expr in dashboard_exprs():
        used |= check_expr(expr, names, where)
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            used |= check_expr(rule["expr"], names, rule["alert"])
    assert not used & DEPRECATED, sorted(used & DEPRECATED)
    assert {"kafka_idem_duplicates_total", "kafka_idem_deliveries_total"} <= used


def test_dashboard_is_provisioned_against_the_prometheus_service() -> None:
    files = mounts("grafana")
    assert DASHBOARD in files.values()
    (ds,) = yaml.safe_load(
        (PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090"
    providers = yaml.safe_load(
        (PROVISIONING / "dashboards" / "kafka_idem.yml").read_text())["providers"]
    dash_dir = {dst.rsplit("/", 1)[0] for dst, src in files.items() if src == DASHBOARD}
    assert {p["options"]["path"] for p in providers} == dash_dir
    board = dashboard()
    (dsvar,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert dsvar["query"] == "prometheus"
    for p in panels(board["panels"]):
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    ids = [p["id"] for p in panels(board["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


# --- the metrics the issue requires ---------------------------------------------------------


def test_required_metrics_exist_with_prometheus_names() -> None:
    names = exported()
    assert set(OUTCOMES) == {"succeeded", "replayed", "busy", "conflict", "retried",
                             "dead_lettered"}
    required = {
        "kafka_idem_messages_total": {"topic", "handler", "outcome"},
        "kafka_idem_handler_duration_seconds_bucket": {"topic", "handler", "le"},
        "kafka_idem_records": {"status"},  # status="processing" among them
        "kafka_idem_expired_leases": set(),
        "kafka_idem_duplicate_ratio": set(),  # deprecated: kept one release
        "kafka_idem_duplicates_total": {"topic", "handler"},
        "kafka_idem_deliveries_total": {"topic", "handler"},
        "kafka_idem_retries_total": {"topic", "handler"},
        "kafka_idem_long_running_records": set(),
        "kafka_idem_consumer_lag_messages": {"topic", "partition"},
        "kafka_idem_dlq_produce_failures_total": {"topic"},
        "kafka_idem_dead_lettered_total": {"topic", "handler", "kind"},
    }
    for name, labels in required.items():
        assert name in names, name
        assert labels <= names[name], (name, names[name])
    for name in names:
        assert re.fullmatch(r"kafka_idem_[a-z0-9_]+", name), name


# --- Dockerfile -------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """The Dockerfile's build stages: (the FROM line, its steps after it)."""
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for op, rest in dockerfile():
        if op == "FROM":
            out.append((rest, []))
        else:
            assert out, f"{op} before any FROM"
            out[-1][1].append((op, rest))
    return out


def copies(steps: list[tuple[str, str]]) -> dict[str, str]:
    """What a stage copies from the build context: source -> destination in the image
    (each source checked to exist in the repository; ``COPY --from=`` is left out)."""
    workdir, copied = "/", {}
    for op, rest in steps:
        if op == "WORKDIR":
            workdir = rest
        if op == "COPY" and not rest.startswith("--from="):
            *sources, dest = rest.split()
            for src in sources:
                if "[" in src:  # an optional file (glob): README.m[d]
                    continue
                assert (ROOT / src).exists(), f"COPY {src}: missing in the repository"
                copied[src.rstrip("/")] = str(Path(workdir) / dest)
    return copied


def test_dockerfile_builds_the_wheel_and_installs_it() -> None:
    """Two stages: the first builds the wheel from the package's source (what a wheel
    build needs, and no more), the runtime installs that wheel: no source install."""
    (build_from, build), (run_from, runtime) = stages()
    assert build_from == "python:3.11-slim AS build"
    assert run_from == "python:3.11-slim"
    assert {"pyproject.toml", "MANIFEST.in", "kafka_idem"} <= set(copies(build))
    assert any(op == "RUN" and "python -m build --wheel --outdir /dist" in rest
               for op, rest in build)
    assert ("COPY", "--from=build /dist/ /tmp/dist/") in runtime
    installs = [rest for op, rest in runtime if op == "RUN" and "pip install" in rest]
    assert installs == ["pip install /tmp/dist/kafka_idem-*-py3-none-any.whl "
                        "&& rm -rf /tmp/dist"]
    for _, steps in stages():  # never the source tree: no `pip install .`, no -e
        assert not [r for op, r in steps if op == "RUN"
                    and re.search(r"pip install (-e |--editable |\.(\s|$))", r)]


def test_dockerfile_runtime_holds_the_app() -> None:
    _, runtime = stages()[-1]
    copied = copies(runtime)
    assert {"consumers", "schemas"} <= set(copied)
    assert "kafka_idem" not in copied  # the library comes from the wheel
    # consumers/payments.py finds its schemas at ../schemas.
    assert Path(copied["consumers"]).parent == Path(copied["schemas"]).parent
    assert ("STOPSIGNAL", "SIGTERM") in runtime
    assert any(op == "USER" and rest != "root" for op, rest in runtime), "run as non-root"


# --- health checks: compose and Kubernetes ---------------------------------------------------


def test_compose_health_check_asks_livez_on_the_metrics_port() -> None:
    svc = services()["payments"]
    test = " ".join(str(t) for t in svc["healthcheck"]["test"])
    assert f"http://127.0.0.1:{metrics_port(svc)}/livez" in test, test
    assert "/metrics" not in test, "a thread answers /metrics even when the loop is stuck"


def kubernetes() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(KUBERNETES.read_text()) if d]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return list(spec["containers"])


def k8s_env(container: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_kubernetes_commands_and_settings_are_real(monkeypatch: pytest.MonkeyPatch) -> None:
    known = known_variables()
    seen = set()
    for doc in kubernetes():
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        for c in containers(doc):
            line = [str(a) for a in c["command"]]
            assert Path(line[0]).name == "kafka-idem", line
            ctx = parse_cli(line)
            seen.add(ctx.info_name)
            for spec in app_specs(ctx):
                assert load_app(spec).handlers
            env = k8s_env(c)
            unknown = [n for n in env if n.startswith(PREFIX) and n not in known]
            assert not unknown, unknown
            with monkeypatch.context() as mp:
                for name in [n for n in os.environ if n.startswith(PREFIX)]:
                    mp.delenv(name)
                for k, v in env.items():
                    if k.startswith(PREFIX) and v is not None:
                        mp.setenv(k, v)
                load_settings()  # the literal values load
    assert seen == {"migrate", "run"}


def test_kubernetes_probes_are_livez_and_readyz_on_the_metrics_port() -> None:
    (deployment,) = [d for d in kubernetes() if d["kind"] == "Deployment"]
    (c,) = containers(deployment)
    line = [str(a) for a in c["command"]]
    port = int(line[line.index("--metrics-port") + 1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert k8s_env(c)[f"{PREFIX}METRICS_ADDR"] == "0.0.0.0"  # probes come from the kubelet

    def target(probe: str) -> tuple[str, int]:
        get = c[probe]["httpGet"]
        p = get["port"]
        return get["path"], ports[p] if isinstance(p, str) else int(p)

    assert target("livenessProbe") == ("/livez", port)
    assert target("readinessProbe") == ("/readyz", port)
    assert target("startupProbe") == ("/livez", port)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= 10
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
