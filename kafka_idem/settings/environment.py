"""Settings from the environment: ``KAFKA_IDEM_*`` variables, the ones that are not
settings (warned about once), and :func:`load_settings`, whose errors name the setting."""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from kafka_idem.errors import ConfigError
from kafka_idem.settings.model import Settings

log = logging.getLogger(__name__)

ENV_PREFIX = "KAFKA_IDEM_"
# KAFKA_IDEM_* variables that are not settings but are read on purpose: by kafka_idem
# itself (admin/audit.py, tools/chaos/services.py), by the test suite, and by the project's scripts
# (scripts/*.sh, ./dev). tests/unit/test_settings.py keeps this list complete.
OWN_VARIABLES = frozenset({
    "KAFKA_IDEM_ACTOR",  # who an audited admin action names (kafka_idem.admin.audit)
    "KAFKA_IDEM_TEST_SCHEMA_REGISTRY_URL",  # the tests' Schema Registry
    "KAFKA_IDEM_ROOT", "KAFKA_IDEM_VENV",  # exported by scripts/bootstrap.sh
    "KAFKA_IDEM_LOCAL_DIR",  # the services' state folder (scripts, ./dev)
    "KAFKA_IDEM_KAFKA_PORT", "KAFKA_IDEM_KAFKA_START_TIMEOUT",  # scripts/kafka.sh
    "KAFKA_IDEM_KAFKA_EXTRA_CONFIG",
    "KAFKA_IDEM_PG_PORT", "KAFKA_IDEM_PG_EXTRA_CONF",  # scripts/postgres.sh
    "KAFKA_IDEM_CITUS_PORT", "KAFKA_IDEM_CITUS_INSTALLER", "KAFKA_IDEM_CITUS_DIR",  # citus.sh
    "KAFKA_IDEM_TEST_CITUS_URL",  # the tests' Citus cluster (tests/citus.py)
    "KAFKA_IDEM_TEST_WORKERS",  # ./dev test's parallel workers (pytest-xdist)
    "KAFKA_IDEM_REGISTRY_PORT", "KAFKA_IDEM_REGISTRY_START_TIMEOUT",  # scripts/registry.sh
    "KAFKA_IDEM_CHROMIUM", "KAFKA_IDEM_CHROMEDRIVER",  # scripts/browser.sh (console tests)
    "KAFKA_IDEM_SCREENSHOTS",  # where the console's browser tests put their screenshots
})
_SAID_UNKNOWN: set[str] = set()  # the unknown variables already warned about (per process)


def setting_variables() -> list[str]:
    """The ``KAFKA_IDEM_*`` name of every setting."""
    return [f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields]


def unknown_variables(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``(variable, the setting it probably meant or None)`` for every ``KAFKA_IDEM_*``
    variable in ``env`` that is neither a setting nor one of :data:`OWN_VARIABLES`
    (names are matched without regard to case, as the settings are read)."""
    settings = setting_variables()
    known = {*settings, *OWN_VARIABLES}
    found = []
    for name in sorted(env):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        # Compared without the prefix they all share (it would make every name close).
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX),
                                          [v.removeprefix(ENV_PREFIX) for v in settings],
                                          n=1, cutoff=0.75)
        found.append((name, f"{ENV_PREFIX}{close[0]}" if close else None))
    return found


def warn_unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """Warn, once per process and variable, about each ``KAFKA_IDEM_*`` variable that
    is not a setting (a misspelt one would otherwise be ignored without a word):
    ``KAFKA_IDEM_BATCH_SIZ is not a setting (did you mean KAFKA_IDEM_BATCH_SIZE?); it
    is ignored``. A warning, not an error: other tools may share the prefix. Never
    the variable's value. Returns the lines said now."""
    said = []
    for name, meant in unknown_variables(os.environ if env is None else env):
        if name in _SAID_UNKNOWN:
            continue
        _SAID_UNKNOWN.add(name)
        hint = f" (did you mean {meant}?)" if meant else ""
        line = f"{name} is not a setting{hint}; it is ignored"
        log.warning("%s", line, extra={"action": "config_unknown", "kind": name})
        said.append(line)
    return said


def load_settings(*, warn_unknown: bool = True, **overrides: Any) -> Settings:
    """Build settings, turning validation errors into a :class:`ConfigError` naming the setting.

    ``warn_unknown``: first warn about ``KAFKA_IDEM_*`` variables that are not
    settings (:func:`warn_unknown_variables`; the CLI does it once its logging is set).

    >>> load_settings(max_attempts=0)
    Traceback (most recent call last):
    kafka_idem.errors.ConfigError: invalid setting max_attempts (KAFKA_IDEM_MAX_ATTEMPTS): ...
    """
    if warn_unknown:
        warn_unknown_variables()
    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**clean)
    except SettingsError as exc:  # a variable that cannot be parsed at all (invalid JSON)
        raise ConfigError(_unparsable(exc)) from exc
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"]) or "settings"
            env = f"KAFKA_IDEM_{name.upper()}"
            problems.append(f"invalid setting {name} ({env}): {err['msg']}")
        raise ConfigError("; ".join(problems)) from exc


_SOURCE_FIELD = re.compile(r'field "(\w+)"')


def _unparsable(exc: SettingsError) -> str:
    """pydantic-settings' "error parsing value for field ..." as a message naming the
    setting, its variable and what is accepted (the value itself is never echoed)."""
    found = _SOURCE_FIELD.search(str(exc))
    name = found[1] if found else "settings"
    env = f"KAFKA_IDEM_{name.upper()}"
    cause = exc.__cause__
    detail = f" ({cause.__class__.__name__}: {cause})" if isinstance(cause, ValueError) else ""
    example = "{\"linger.ms\": 5}"
    return f"invalid setting {name} ({env}): not valid JSON{detail}; e.g. {env}='{example}'"
