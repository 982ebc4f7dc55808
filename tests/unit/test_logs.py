"""The text log format keeps one record on one line, whatever the data says."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kafka_idem.observe import logs


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    out = io.StringIO()
    logs.configure("text")
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(out)
    try:
        yield out
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


@pytest.mark.parametrize("evil", ["k\nINFO forged line", "k\r\nx", "k\x1b[31mred", "k\u2028x"])
def test_a_key_or_message_with_control_characters_cannot_forge_a_log_line(
    captured: io.StringIO, evil: str
) -> None:
    log = logging.getLogger("kafka_idem.test")
    log.warning("failed: %s", evil, extra={"action": "failed", "key": evil})
    text = captured.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "\x1b" not in text and "\r" not in text and "\u2028" not in text
    assert repr(evil)[1:-1] in text  # still readable, escaped


def test_json_format_keeps_control_characters_as_json_escapes() -> None:
    record = logging.makeLogRecord({"msg": "x", "key": "a\nb", "levelname": "INFO"})
    data = json.loads(logs.JsonFormatter().format(record))
    assert data["key"] == "a\nb"


def test_a_dead_letters_error_is_a_json_field_and_said_once_in_text(
    captured: io.StringIO,
) -> None:
    log = logging.getLogger("kafka_idem.test")
    extra = {"action": "failed", "kind": "permanent", "error_class": "Permanent",
             "error_message": "card declined", "key": "t1:o1"}
    log.warning("dead-lettering (%s): %s: %s", "permanent", "Permanent", "card declined",
                extra=extra)
    text = captured.getvalue()
    assert text.count("card declined") == 1 and "error_class=Permanent" in text
    record = logging.makeLogRecord({"msg": "x", "levelname": "WARNING", **extra})
    data = json.loads(logs.JsonFormatter().format(record))
    assert (data["kind"], data["error_class"], data["error_message"]) == (
        "permanent", "Permanent", "card declined")


def test_a_field_without_a_value_is_left_out_of_a_text_line(captured: io.StringIO) -> None:
    log = logging.getLogger("kafka_idem.test")
    log.warning("dead-lettering (undecodable)", extra={"action": "rejected", "key": None,
                                                       "topic": "t", "offset": 0})
    text = captured.getvalue()
    assert text.rstrip().endswith("dead-lettering (undecodable) action=rejected topic=t offset=0")
    assert "key=" not in text


def test_a_json_line_has_a_utc_timestamp_with_milliseconds() -> None:
    import datetime as dt

    record = logging.LogRecord("kafka_idem.t", logging.INFO, __file__, 1, "hi", None, None)
    record.created = 1_700_000_000.25
    data = json.loads(logs.JsonFormatter().format(record))
    assert data["ts"] == "2023-11-14T22:13:20.250+00:00"
    assert dt.datetime.fromisoformat(data["ts"]).timestamp() == record.created


def _record(name: str, level: int) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, "line", None, None)


def test_other_libraries_show_warnings_only_unless_named_in_log_levels() -> None:
    import urllib3  # noqa: F401  (installed: a library)

    from kafka_idem.observe.logs import Libraries

    quiet = Libraries()
    assert not quiet.filter(_record("urllib3.connectionpool", logging.INFO))
    assert not quiet.filter(_record("asyncio", logging.INFO))  # the standard library's
    assert quiet.filter(_record("urllib3.connectionpool", logging.WARNING))
    for own in ("kafka_idem.consume.runner", "billing.invoices", "__main__"):
        assert quiet.filter(_record(own, logging.INFO)), own
    quiet.levels = {"urllib3": "INFO"}  # a parent named in log_levels: its level decides
    assert quiet.filter(_record("urllib3.connectionpool", logging.INFO))
    quiet.levels = {}
    quiet.own_modules(["urllib3.poolmanager"])  # an app installed like a library is the app's
    assert quiet.filter(_record("urllib3.connectionpool", logging.DEBUG))


def test_log_levels_are_normalised_and_a_bad_one_names_the_setting() -> None:
    from kafka_idem.errors import ConfigError
    from kafka_idem.settings import load_settings

    s = load_settings(log_levels=" httpx=info , myapp.db=DEBUG,")
    assert s.log_levels == "httpx=INFO,myapp.db=DEBUG"
    assert s.logger_levels == {"httpx": "INFO", "myapp.db": "DEBUG"}
    for bad, said in (("httpx", "'httpx' is not LOGGER=LEVEL"),
                      ("=INFO", "'=INFO' is not LOGGER=LEVEL"),
                      ("httpx=LOUD", "'httpx=LOUD': the level must be one of")):
        with pytest.raises(ConfigError) as caught:
            load_settings(log_levels=bad)
        assert "log_levels (KAFKA_IDEM_LOG_LEVELS)" in str(caught.value)
        assert said in str(caught.value)
