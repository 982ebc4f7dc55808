"""redact(): passwords in URLs, query strings, keyword/value conninfo strings, librdkafka
options and known secret values never survive, and nothing else is touched."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kafka_idem.observe.redact import (
    MASK,
    option_secrets,
    redact,
    redact_options,
    secrets_in,
)

# Passwords as users write them: printable, with the characters that break naive parsers.
PASSWORD = st.text(
    alphabet=st.characters(codec="utf-8", categories=("L", "N", "P", "S"),
                           exclude_characters="\x00"),
    min_size=1, max_size=24,
)


# --- URL userinfo --------------------------------------------------------------------


@given(PASSWORD)
def test_a_url_password_is_masked_whatever_it_contains(password: str) -> None:
    url = f"postgresql://app:{quote(password, safe='')}@db.example:5432/app?sslmode=require"
    assert redact(url) == f"postgresql://app:{MASK}@db.example:5432/app?sslmode=require"


@given(PASSWORD)
def test_a_raw_password_in_a_malformed_url_echoed_by_libpq_is_masked(password: str) -> None:
    assume(not any(c.isspace() or c in "\"'<>" for c in password))
    message = f'missing "=" after "postgresql//app:{password}@db:5432/app" in connection info'
    assert redact(message) == (f'missing "=" after "postgresql//app:{MASK}@db:5432/app" '
                               "in connection info")


def test_a_url_without_password_is_unchanged() -> None:
    for url in ("postgresql://kafka_idem@127.0.0.1:55432/kafka_idem",
                "postgresql://127.0.0.1:55432/kafka_idem", "http://registry:8081"):
        assert redact(url) == url


def test_an_empty_user_and_a_raw_at_sign_in_the_password() -> None:
    assert redact("postgresql://:p@ss@db/app") == f"postgresql://:{MASK}@db/app"
    assert redact("https://u:pw@registry:8081/x") == f"https://u:{MASK}@registry:8081/x"


# --- query strings ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["password", "sslpassword", "PASSWORD", "sasl.password",
                                  "ssl.key.password"])
@given(password=PASSWORD)
def test_a_query_string_password_is_masked_and_the_other_parameters_kept(
    name: str, password: str
) -> None:
    url = (f"postgresql://app@db/app?sslmode=require&{name}={quote(password, safe='')}"
           "&application_name=x")
    assert redact(url) == (f"postgresql://app@db/app?sslmode=require&{name}={MASK}"
                           "&application_name=x")


def test_a_password_first_in_the_query_string() -> None:
    assert redact("postgresql://db/app?password=s3cret") == f"postgresql://db/app?password={MASK}"


# --- keyword/value conninfo ----------------------------------------------------------------


@given(PASSWORD)
def test_a_keyword_password_is_masked(password: str) -> None:
    assume(not any(c.isspace() or c in "\"'\\" for c in password))
    text = f"host=db port=5432 password={password} dbname=app"
    assert redact(text) == f"host=db port=5432 password={MASK} dbname=app"


@given(st.text(min_size=1, max_size=24).filter(lambda p: "\n" not in p))
def test_a_quoted_keyword_password_is_masked_with_its_escapes(password: str) -> None:
    escaped = password.replace("\\", "\\\\").replace("'", "\\'")
    text = f"host=db password = '{escaped}' dbname=app"
    assert redact(text) == f"host=db password = '{MASK}' dbname=app"


def test_keyword_forms_of_every_secret_option() -> None:
    text = "sslpassword=a1 sasl.password=b2 ssl.key.password='c 3' user=app host=db"
    assert redact(text) == (f"sslpassword={MASK} sasl.password={MASK} "
                            f"ssl.key.password='{MASK}' user=app host=db")


def test_json_and_dict_forms_of_secret_options() -> None:
    options = {"sasl.username": "svc", "sasl.password": "k-pw", "ssl.key.password": "x y"}
    shown = redact(json.dumps(options))
    assert json.loads(shown) == {"sasl.username": "svc", "sasl.password": MASK,
                                 "ssl.key.password": MASK}
    assert "k-pw" not in redact(repr(options)) and "x y" not in redact(repr(options))


def test_words_about_passwords_are_not_values() -> None:
    text = 'FATAL: password authentication failed for user "app"'
    assert redact(text) == text


# --- known secrets ------------------------------------------------------------------------


@given(PASSWORD)
def test_a_known_secret_is_masked_anywhere_raw_or_percent_encoded(password: str) -> None:
    assume(len(password) >= 6 and password not in MASK)
    text = f'unexpected spaces found in "{password}"; also {quote(password, safe="")}'
    shown = redact(text, [password])
    assert password not in shown
    assert quote(password, safe="") not in shown


def test_a_short_known_secret_is_masked_as_a_word_only() -> None:
    assert redact('bad "k" in kafka_idem', ["k"]) == f'bad "{MASK}" in kafka_idem'


def test_redact_is_idempotent() -> None:
    text = "postgresql://u:pw@h/db?password=x host=h password='y z' {\"sasl.password\": \"q\"}"
    once = redact(text, ["pw"])
    assert redact(once, ["pw"]) == once


# --- finding the secrets of a configuration string ---------------------------------------


@pytest.mark.parametrize(("dsn", "secret"), [
    ("postgresql://app:s3cret@db/app", "s3cret"),
    ("postgresql://app:p%40ss@db/app", "p@ss"),
    ("postgresql//app:s3cret@db/app", "s3cret"),  # malformed: no ':' after the scheme
    ("postgresql://app:s3c ret@db/app", "s3c ret"),  # malformed: a raw space
    ("postgresql://app:s3%cret@db/app", "s3%cret"),  # malformed: a bad escape
    ("postgresql://app@db/app?password=s3cret&sslmode=require", "s3cret"),
    ("host=db password=s3cret dbname=app", "s3cret"),
    ("host=db password='s3 cret' dbname=app", "s3 cret"),
    ("host=db password='s3 cret", "s3 cret"),  # malformed: unterminated quote
])
def test_secrets_in_finds_the_password_of_well_formed_and_malformed_dsns(
    dsn: str, secret: str
) -> None:
    assert secret in secrets_in(dsn)


def test_secrets_in_a_dsn_without_password_is_empty() -> None:
    assert secrets_in("postgresql://kafka_idem@127.0.0.1:55432/kafka_idem") == []


def test_option_dicts() -> None:
    options = {"sasl.password": "pw", "ssl.key.pem": "----", "linger.ms": 5,
               "sasl.username": "svc"}
    assert redact_options(options) == {"sasl.password": MASK, "ssl.key.pem": MASK,
                                       "linger.ms": 5, "sasl.username": "svc"}
    assert sorted(option_secrets(options)) == ["----", "pw"]
