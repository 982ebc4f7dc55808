"""Masking secrets in text: the one place a password is hidden before text is shown.

    >>> redact("postgresql://app:s3cret@db:5432/app")
    'postgresql://app:**********@db:5432/app'
    >>> redact("host=db password='my secret' dbname=app")
    "host=db password='**********' dbname=app"
    >>> redact("postgresql://app@db/app?sslmode=require&password=s3cret")
    'postgresql://app@db/app?sslmode=require&password=**********'
    >>> redact('unexpected spaces found in "s3c ret"', ["s3c ret"])
    'unexpected spaces found in "**********"'

:func:`redact` masks what looks like a secret wherever it appears — the password
of a URL's userinfo, ``password=`` / ``sslpassword=`` in a query string or a
keyword/value conninfo string, librdkafka secret options (``sasl.password``,
``ssl.key.password``...) written as ``key=value`` or ``"key": "value"`` — and
every known secret value passed in (an error may echo a password out of its
context, as libpq does for a malformed URL). :func:`secrets_in` finds the
secret values of one configuration string, malformed or not, so they can be
passed in. Every URL, error text and report kafka_idem shows goes through
:func:`redact`; the librdkafka option dicts go through :func:`redact_options`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, unquote

MASK = "**********"
ANYWHERE = 6  # a known secret this long is masked inside words too

# Option / parameter names whose value is a secret (libpq, librdkafka, generic).
_KEY = (r"(?:[a-z0-9_.\-]*(?:password|passwd|passphrase|secret)"
        r"|ssl\.key\.pem|sasl\.oauthbearer\.config)")

# ``//user:password@`` (the password runs to the last ``@`` of the token: a raw ``@``
# in a malformed URL's password is masked too, at worst with some of the host).
_USERINFO = re.compile(r"(?P<pre>//[^\s/?#@:\"'<>]*:)(?P<value>[^\s\"'<>]*)@")
# ``?password=...`` / ``&sslpassword=...`` in a query string: the value ends at ``&``.
_QUERY = re.compile(rf"(?P<pre>[?&]{_KEY}=)(?P<value>[^&#\s\"'<>]*)", re.IGNORECASE)
# ``password=secret`` / ``password = 'quoted \' secret'`` (libpq keyword/value form).
_ASSIGN = re.compile(
    rf"(?P<pre>(?<![\w.\-?&]){_KEY}\s*=\s*)"
    r"(?P<value>'(?:[^'\\\n]|\\.)*(?:'|$)|\"(?:[^\"\\\n]|\\.)*(?:\"|$)|[^\s\"']*)",
    re.IGNORECASE | re.MULTILINE,
)
# ``"sasl.password": "secret"`` / ``'password': 'secret'`` (JSON, a Python dict's repr).
_QUOTED = re.compile(
    rf"(?P<pre>(?P<q>[\"']){_KEY}(?P=q)\s*:\s*)"
    r"(?P<value>\"(?:[^\"\\\n]|\\.)*(?:\"|$)|'(?:[^'\\\n]|\\.)*(?:'|$)|[^\s,}\]]*)",
    re.IGNORECASE | re.MULTILINE,
)
_PATTERNS = (_USERINFO, _QUERY, _ASSIGN, _QUOTED)
# A whole DSN is one value: its password runs from ``user:`` to its *last* ``@``,
# even across spaces (libpq then echoes it alone: ``unexpected spaces found in "..."``).
_DSN_USERINFO = re.compile(r"^[^/\s]*//[^:@/]*:(?P<value>.*)@", re.DOTALL)

# Option names of librdkafka dicts whose values are never shown.
_SECRET_OPTION_WORDS = ("password", "secret", "token", "key.pem", ".key", "user.info")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every password-like value and every one of ``secrets`` masked.

    Known secrets are replaced raw and percent-encoded, longest first: wherever they
    occur when at least :data:`ANYWHERE` characters long, else only as a whole word
    (a one-letter password must not mask every such letter). An empty secret is
    ignored. Idempotent.
    """
    known: set[str] = set()
    for secret in secrets:
        if secret:
            known.update({secret, quote(secret, safe="")})
    for secret in sorted(known, key=len, reverse=True):
        if len(secret) >= ANYWHERE:
            text = text.replace(secret, MASK)
        else:
            text = re.sub(rf"(?<!\w){re.escape(secret)}(?!\w)", MASK, text)
    for pattern in _PATTERNS:
        text = pattern.sub(_mask, text)
    return text


def _mask(match: re.Match[str]) -> str:
    """The match with its value masked; a quoted value keeps its quotes."""
    value = match["value"]
    if match.re is _USERINFO:
        return f"{match['pre']}{MASK}@"
    if value[:1] in ("'", '"'):
        closing = value[0] if len(value) >= 2 and value[-1] == value[0] else ""
        return f"{match['pre']}{value[0]}{MASK}{closing}"
    return f"{match['pre']}{MASK}"


def secrets_in(text: str) -> list[str]:
    """The secret values written in ``text`` (a DSN, a URL, a conninfo string, JSON
    options), as written and decoded, whether or not ``text`` is well formed."""
    found: list[str] = []
    loose = _DSN_USERINFO.match(text.strip())
    if loose:
        found.append(loose["value"])
    for pattern in _PATTERNS:
        for match in pattern.finditer(text):
            found.append(match["value"])
    found.extend(_conninfo_passwords(text))
    values: list[str] = []
    for value in found:
        for form in (value, _unquote(value), unquote(value)):
            # A raw '@' or ':' in a password splits it when libpq parses the URL (an
            # error then quotes a piece, e.g. the host 'PW@db'): mask the pieces too.
            parts = re.split(r"[@:/]", form)
            pieces = [p for p in parts if len(p) >= 2] if len(parts) > 1 else []
            for item in (form, *pieces):
                if item and item != MASK and item not in values:
                    values.append(item)
    return values


def _unquote(value: str) -> str:
    """A quoted conninfo / JSON value without its quotes and backslash escapes."""
    if len(value) >= 1 and value[0] in "'\"":
        body = value[1:-1] if len(value) >= 2 and value[-1] == value[0] else value[1:]
        return re.sub(r"\\(.)", r"\1", body)
    return value


def _conninfo_passwords(text: str) -> list[str]:
    try:
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(text)
    except Exception:  # malformed: the patterns above found what can be found
        return []
    return [str(params[k]) for k in ("password", "sslpassword") if params.get(k)]


def is_secret_option(name: str) -> bool:
    """Whether a librdkafka option's value is a secret (``sasl.password``, ``ssl.key.pem``...)."""
    return any(word in name.lower() for word in _SECRET_OPTION_WORDS)


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """librdkafka options for display: secret options' values masked."""
    return {k: (MASK if is_secret_option(k) else v) for k, v in options.items()}


def option_secrets(options: Mapping[str, Any]) -> list[str]:
    """The values of the secret options (to mask them wherever an error echoes them)."""
    return [v for k, v in options.items() if is_secret_option(k) and isinstance(v, str) and v]


__all__ = ["ANYWHERE", "MASK", "is_secret_option", "option_secrets", "redact", "redact_options",
           "secrets_in"]
