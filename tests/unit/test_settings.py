"""Settings: KAFKA_IDEM_* variables, validation errors naming the setting, protected options."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from kafka_idem.errors import ConfigError
from kafka_idem.settings import Settings, load_settings
from kafka_idem.settings import environment as settings_module

SECRET = "s3cr3t-pa55"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KAFKA_IDEM_* from the developer's shell leaks into these tests."""
    for name in list(os.environ):
        if name.startswith("KAFKA_IDEM_"):
            monkeypatch.delenv(name)


# --- environment ------------------------------------------------------------------


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_IDEM_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    monkeypatch.setenv("KAFKA_IDEM_DATABASE_URL", f"postgresql://app:{SECRET}@127.0.0.1:5/db")
    monkeypatch.setenv("KAFKA_IDEM_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("KAFKA_IDEM_LEASE_SECONDS", "2.5")
    monkeypatch.setenv("KAFKA_IDEM_SCHEMA_NAME", "billing")
    monkeypatch.setenv("KAFKA_IDEM_LOG_FORMAT", "json")
    monkeypatch.setenv("KAFKA_IDEM_SCHEMAS_DIR", "/opt/schemas")
    monkeypatch.setenv("KAFKA_IDEM_KAFKA", '{"security.protocol": "SASL_SSL", "linger.ms": 20}')
    s = load_settings()
    assert s.bootstrap_servers == "127.0.0.1:19092"
    assert s.dsn == f"postgresql://app:{SECRET}@127.0.0.1:5/db"
    assert s.max_attempts == 7
    assert s.lease_seconds == 2.5
    assert s.schema_name == "billing"
    assert s.log_format == "json"
    assert s.schemas_dir == Path("/opt/schemas")
    assert s.kafka == {"security.protocol": "SASL_SSL", "linger.ms": 20}
    assert s.consumer_config("g")["security.protocol"] == "SASL_SSL"
    assert s.producer_config()["linger.ms"] == 20


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_IDEM_MAX_ATTEMPTS", "7")
    assert load_settings(max_attempts=3).max_attempts == 3
    assert load_settings(max_attempts=None).max_attempts == 7  # None means "not given"


def test_defaults_without_environment() -> None:
    s = Settings()
    assert s.bootstrap_servers == "127.0.0.1:39092"
    assert s.schema_name == "kafka_idem"
    assert s.table == "task_idempotency"
    assert s.max_attempts == 5


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(Exception, match="frozen"):
        s.max_attempts = 9  # type: ignore[misc]


# --- validation errors name the setting and its variable -------------------------


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("max_attempts", 0),
        ("table", "bad;name"),
        ("table", "Upper"),
        ("schema_name", 'pay"ments'),
        ("schema_name", "x" * 41),
        ("log_format", "xml"),
        ("lease_seconds", 0),
        ("batch_size", 0),
        ("error_message_max", 10),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_setting_and_its_variable(
    setting: str, value: Any
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**{setting: value})
    text = str(info.value)
    assert f"invalid setting {setting} " in text
    assert f"(KAFKA_IDEM_{setting.upper()})" in text


@pytest.mark.parametrize(
    ("variable", "value"),
    [("KAFKA_IDEM_MAX_ATTEMPTS", "0"), ("KAFKA_IDEM_TABLE", "t; DROP TABLE x"),
     ("KAFKA_IDEM_LOG_FORMAT", "xml"), ("KAFKA_IDEM_MAX_ATTEMPTS", "many")],
)
def test_a_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        load_settings()


def test_a_bad_value_never_echoes_the_database_secret() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(database_url=f"postgresql://app:{SECRET}@h/db", max_attempts=0)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value)


def test_backoff_cap_below_base_is_refused() -> None:
    with pytest.raises(ConfigError, match="backoff_cap_seconds must be >= backoff_base_seconds"):
        load_settings(backoff_base_seconds=10, backoff_cap_seconds=1)


def test_a_batch_linger_longer_than_the_batch_wait_is_refused() -> None:
    assert load_settings().batch_linger_seconds == 0.0  # batches start at once
    assert load_settings(batch_linger_seconds=0.1).batch_linger_seconds == 0.1
    named = r"batch_linger_seconds \(KAFKA_IDEM_BATCH_LINGER_SECONDS\)"
    with pytest.raises(ConfigError, match=named + r".*longer than batch_max_wait_seconds"):
        load_settings(batch_linger_seconds=0.5, batch_max_wait_seconds=0.2)
    with pytest.raises(ConfigError, match="KAFKA_IDEM_BATCH_LINGER_SECONDS"):
        load_settings(batch_linger_seconds=-1)


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_attemps"):
        load_settings(max_attemps=3)


# --- librdkafka options the guarantees depend on ---------------------------------

HOSTILE = {
    "enable.auto.commit": True,
    "enable.auto.offset.store": True,
    "enable.partition.eof": True,
    "enable.idempotence": False,
    "acks": "1",
    "group.id": "someone-else",
    "bootstrap.servers": "10.9.9.9:9092",
    "fetch.wait.max.ms": 7,
    "client.id": "mine",
}


def test_protected_consumer_options_cannot_be_overridden_through_kafka() -> None:
    conf = Settings(kafka=HOSTILE).consumer_config("payments")
    assert conf["enable.auto.commit"] is False
    assert conf["enable.auto.offset.store"] is False
    assert conf["enable.partition.eof"] is False
    assert conf["group.id"] == "payments"
    assert conf["bootstrap.servers"] == "127.0.0.1:39092"
    # Ordinary tuning still passes through.
    assert conf["fetch.wait.max.ms"] == 7
    assert conf["client.id"] == "mine"


def test_consumer_needs_a_group() -> None:
    with pytest.raises(ConfigError, match="group_id"):
        Settings().consumer_config()
    assert Settings(group_id="g1").consumer_config()["group.id"] == "g1"


def test_producer_is_idempotent_with_acks_all_whatever_kafka_says() -> None:
    conf = Settings(kafka=HOSTILE).producer_config()
    assert conf["enable.idempotence"] is True
    assert conf["acks"] == "all"
    assert conf["bootstrap.servers"] == "127.0.0.1:39092"
    assert "group.id" not in conf and "fetch.wait.max.ms" not in conf
    assert conf["client.id"] == "mine"
    plain = Settings().producer_config()
    assert plain["enable.idempotence"] is True and plain["acks"] == "all"


# --- secrets -----------------------------------------------------------------------


def secret_settings() -> Settings:
    return Settings(
        database_url=f"postgresql://app:{SECRET}@127.0.0.1:55432/kafka_idem",
        kafka={"sasl.username": "svc", "sasl.password": "kafka-pw-123", "ssl.key.password": "k"},
    )


def test_redacted_masks_the_database_password_and_secret_kafka_options() -> None:
    shown = secret_settings().redacted()
    assert SECRET not in str(shown)
    assert shown["database_url"] == "postgresql://app:**********@127.0.0.1:55432/kafka_idem"
    assert shown["kafka"]["sasl.password"] == "**********"
    assert shown["kafka"]["ssl.key.password"] == "**********"
    assert shown["kafka"]["sasl.username"] == "svc"
    assert "kafka-pw-123" not in str(shown)


def test_redacted_keeps_a_url_without_password() -> None:
    url = "postgresql://kafka_idem@127.0.0.1:55432/kafka_idem"
    assert Settings(database_url=url).redacted()["database_url"] == url


def test_the_database_secret_never_appears_in_repr_or_str() -> None:
    s = secret_settings()
    assert SECRET not in repr(s)
    assert SECRET not in str(s)
    assert SECRET not in repr(s.database_url)
    assert s.dsn.endswith("@127.0.0.1:55432/kafka_idem")  # still usable


def test_kafka_secrets_never_appear_in_repr_or_str() -> None:
    s = secret_settings()
    assert "kafka-pw-123" not in repr(s)
    assert "kafka-pw-123" not in str(s)


@pytest.mark.parametrize("url", [
    f"postgresql://app@127.0.0.1:55432/kafka_idem?sslmode=prefer&password={SECRET}",
    f"postgresql://app@127.0.0.1:55432/kafka_idem?sslpassword={SECRET}",
    f"host=127.0.0.1 port=55432 user=app password={SECRET} dbname=kafka_idem",
    f"host=127.0.0.1 user=app password='{SECRET} with spaces' dbname=kafka_idem",
])
def test_redacted_masks_query_string_and_keyword_passwords(url: str) -> None:
    s = Settings(database_url=url)
    shown = s.redacted()
    assert SECRET not in str(shown)
    assert "**********" in shown["database_url"]
    assert "127.0.0.1" in shown["database_url"]
    assert SECRET in " ".join(s.secret_values())  # what callers pass to redact()


def test_a_registry_url_password_is_masked_everywhere() -> None:
    s = Settings(schema_registry_url=f"https://svc:{SECRET}@registry:8081")
    assert SECRET not in str(s.redacted()) and SECRET not in repr(s)
    assert s.redacted()["schema_registry_url"] == "https://svc:**********@registry:8081"


@pytest.mark.parametrize("url", [
    f"postgresql//app:{SECRET}@127.0.0.1:55432/kafka_idem",  # libpq echoes it back
    f"postgresql://app:{SECRET} x@127.0.0.1:55432/kafka_idem",
    f"host=127.0.0.1 password='{SECRET}",
])
def test_a_malformed_database_url_is_a_config_error_that_hides_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(database_url=url)
    text = str(info.value)
    assert "invalid setting database_url (KAFKA_IDEM_DATABASE_URL)" in text
    assert SECRET not in text


# --- names are matched whole -------------------------------------------------------------


@pytest.mark.parametrize(("setting", "value"), [
    ("schema_name", "payments\n"), ("table", "task_idempotency\n"), ("schema_name", "\nx"),
    ("group_id", "payments\n"), ("group_id", ""), ("group_id", " payments"),
    ("group_id", "pay\x1bments"), ("dlq_suffix", ".dlq\n"), ("metrics_addr", "127.0.0.1\n"),
    ("namespace", ""), ("namespace", "shop\n"), ("namespace", " shop"), ("namespace", "é" * 101),
])
def test_a_name_with_a_trailing_newline_or_control_character_is_refused(
    setting: str, value: str
) -> None:
    with pytest.raises(ConfigError, match=f"invalid setting {setting} "):
        load_settings(**{setting: value})


def test_a_schema_name_from_the_environment_with_a_trailing_newline_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAFKA_IDEM_SCHEMA_NAME", "billing\n")
    with pytest.raises(ConfigError, match="KAFKA_IDEM_SCHEMA_NAME"):
        load_settings()


def test_invalid_json_in_kafka_is_a_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAFKA_IDEM_KAFKA", '{"sasl.password": "kafka-pw-123", oops}')
    with pytest.raises(ConfigError) as info:
        load_settings()
    text = str(info.value)
    assert "invalid setting kafka (KAFKA_IDEM_KAFKA): not valid JSON" in text
    assert "kafka-pw-123" not in text


def test_an_app_namespace_defaults_to_its_name_and_is_checked() -> None:
    from kafka_idem import App

    assert App("shop").namespace == "shop"
    assert App("shop", namespace="shared").namespace == "shared"
    assert App("é" * 100).namespace == "é" * 100  # 200 bytes: the limit
    with pytest.raises(ConfigError) as info:
        _ = App("bad\nname").namespace
    assert "KAFKA_IDEM_NAMESPACE" in str(info.value) and "'bad\\nname'" in str(info.value)


# --- group membership -------------------------------------------------------------


def test_a_member_is_dynamic_by_default_with_a_ten_second_session() -> None:
    conf = Settings().consumer_config("g")
    assert "group.instance.id" not in conf
    assert conf["session.timeout.ms"] == 10_000


def test_static_membership_sets_group_instance_id_with_the_host_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "payments-2")
    monkeypatch.setenv("KAFKA_IDEM_GROUP_INSTANCE_ID", "{hostname}-a")
    s = load_settings()
    assert s.group_instance_id == "payments-2-a"
    assert s.consumer_config("g")["group.instance.id"] == "payments-2-a"


@pytest.mark.parametrize("value", ["", "a b", "näme", "x" * 250, ".."])
def test_a_group_instance_id_kafka_would_refuse_names_the_setting(value: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid setting group_instance_id "
                       r"\(KAFKA_IDEM_GROUP_INSTANCE_ID\): .*not a usable group\.instance\.id"):
        load_settings(group_instance_id=value)


# --- librdkafka options checked when the settings are made ------------------------------


@pytest.mark.parametrize(("options", "named"), [
    ({"nope.option": 1}, "option 'nope.option': No such configuration property"),
    ({"client.id": "mine", "linger.ms": "soon"}, "option 'linger.ms': Invalid value"),
])
def test_an_option_librdkafka_refuses_is_a_configuration_error_naming_it(
    options: dict[str, object], named: str,
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(kafka=options)
    assert str(caught.value).startswith("invalid setting kafka (KAFKA_IDEM_KAFKA): ")
    assert named in str(caught.value)


def test_an_ignored_option_in_kafka_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    from kafka_idem.settings import clients as module

    module._WARNED.clear()
    s = Settings(kafka={"enable.auto.commit": True, "session.timeout.ms": 1000,
                        "enable.auto.offset.store": False, "acks": "1", "client.id": "c"})
    with caplog.at_level("WARNING", logger="kafka_idem.settings"):
        for _ in range(3):
            s.consumer_config("g")
            s.producer_config()
    said = sorted(r.getMessage() for r in caplog.records)
    assert said == [
        "librdkafka option acks in kafka (KAFKA_IDEM_KAFKA) is ignored: kafka_idem always "
        "uses acks=all (the exactly-once effects depend on it)",
        "librdkafka option enable.auto.commit in kafka (KAFKA_IDEM_KAFKA) is ignored: "
        "kafka_idem always uses enable.auto.commit=false (the exactly-once effects depend on it)",
        "librdkafka option session.timeout.ms in kafka (KAFKA_IDEM_KAFKA) is ignored: set "
        "session_timeout_ms (KAFKA_IDEM_SESSION_TIMEOUT_MS)",
    ]  # enable.auto.offset.store=false is what it uses anyway: nothing to say


# --- variables that are not settings -----------------------------------------------


@pytest.fixture
def unknown_said(monkeypatch: pytest.MonkeyPatch,
                 caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """A process that has said nothing yet about unknown variables; its warnings."""
    monkeypatch.setattr(settings_module, "_SAID_UNKNOWN", set())
    caplog.set_level(logging.WARNING, logger="kafka_idem.settings")
    return caplog


def unknown_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if getattr(r, "action", None) == "config_unknown"]


def test_a_misspelt_variable_is_warned_about_naming_the_setting_it_meant(
    monkeypatch: pytest.MonkeyPatch, unknown_said: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("KAFKA_IDEM_BATCH_SIZ", "50")
    monkeypatch.setenv("KAFKA_IDEM_DATABSE_URL", f"postgresql://app:{SECRET}@db/app")
    monkeypatch.setenv("KAFKA_IDEM_WHATEVER_ELSE", "1")
    s = load_settings()
    assert s.batch_size == 500  # ignored, as the warning says
    assert unknown_lines(unknown_said) == [
        "KAFKA_IDEM_BATCH_SIZ is not a setting (did you mean KAFKA_IDEM_BATCH_SIZE?); "
        "it is ignored",
        "KAFKA_IDEM_DATABSE_URL is not a setting (did you mean KAFKA_IDEM_DATABASE_URL?); "
        "it is ignored",
        "KAFKA_IDEM_WHATEVER_ELSE is not a setting; it is ignored",
    ]
    first = next(r for r in unknown_said.records if getattr(r, "action", None))
    assert (first.levelno, first.name, getattr(first, "kind", None)) == (
        logging.WARNING, "kafka_idem.settings.environment", "KAFKA_IDEM_BATCH_SIZ")
    assert SECRET not in unknown_said.text  # never a value


def test_an_unknown_variable_is_said_once_per_process_not_per_app(
    monkeypatch: pytest.MonkeyPatch, unknown_said: pytest.LogCaptureFixture,
) -> None:
    from kafka_idem import App

    monkeypatch.setenv("KAFKA_IDEM_MAX_ATTEMTPS", "3")
    for name in ("one", "two", "three"):
        app = App(name)
        assert app.settings.max_attempts == 5
        app.configure(batch_size=10)
        assert app.settings.batch_size == 10
    load_settings()
    assert unknown_lines(unknown_said) == [
        "KAFKA_IDEM_MAX_ATTEMTPS is not a setting (did you mean KAFKA_IDEM_MAX_ATTEMPTS?); "
        "it is ignored"]
    monkeypatch.setenv("KAFKA_IDEM_LEASE_SECOND", "3")  # a new one is said, once
    load_settings()
    load_settings()
    assert unknown_lines(unknown_said)[1:] == [
        "KAFKA_IDEM_LEASE_SECOND is not a setting (did you mean KAFKA_IDEM_LEASE_SECONDS?); "
        "it is ignored"]


def test_settings_and_the_projects_own_variables_are_not_warned_about(
    monkeypatch: pytest.MonkeyPatch, unknown_said: pytest.LogCaptureFixture,
) -> None:
    for name in settings_module.OWN_VARIABLES:
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("KAFKA_IDEM_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("kafka_idem_batch_size", "7")  # read as a setting: any case
    monkeypatch.setenv("OTHER_KAFKA_IDEM_THING", "1")  # not the prefix
    s = load_settings()
    assert (s.max_attempts, s.batch_size) == (3, 7)
    assert unknown_lines(unknown_said) == []


def test_every_kafka_idem_variable_the_project_reads_is_a_setting_or_its_own() -> None:
    """OWN_VARIABLES stays complete: the names the scripts and ./dev use, and those
    read with os.environ in kafka_idem/ and the tests' conftest."""
    root = Path(__file__).resolve().parents[2]
    name = re.compile(r"\bKAFKA_IDEM_[A-Z0-9_]*[A-Z0-9]\b")
    read = re.compile(r"environ(?:\.get)?[\[(]\s*[\"'](KAFKA_IDEM_[A-Z0-9_]+)")
    used: set[tuple[str, str]] = set()
    for path in [root / "dev", *sorted((root / "scripts").iterdir())]:
        if path.is_file():
            used |= {(path.name, n) for n in name.findall(path.read_text())}
    for path in [*(root / "kafka_idem").rglob("*.py"), root / "tests" / "conftest.py"]:
        used |= {(path.name, n) for n in read.findall(path.read_text())}
    assert ("bootstrap.sh", "KAFKA_IDEM_ROOT") in used and ("audit.py", "KAFKA_IDEM_ACTOR") in used
    known = {*settings_module.setting_variables(), *settings_module.OWN_VARIABLES}
    assert sorted(f"{where}: {n}" for where, n in used if n not in known) == []


def test_a_misspelt_app_keyword_is_refused_at_once_naming_the_setting_it_meant() -> None:
    from kafka_idem import App

    with pytest.raises(ConfigError) as e:
        App("typo", batch_siz=3)
    text = str(e.value)
    assert "App('typo') got batch_siz=, which is not a setting (did you mean batch_size=?)" \
        in text
    assert e.value.context == {"setting": "batch_siz"}
    with pytest.raises(ConfigError, match=r"got colour=, which is not a setting;"):
        App("typo", colour="blue")  # nothing close: no guess
    assert App("fine", batch_size=3).settings.batch_size == 3  # real ones still work
