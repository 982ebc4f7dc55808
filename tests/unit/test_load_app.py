"""``MODULE:APP`` as the CLI resolves it: a wrong attribute names what the module has."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from kafka_idem.cli.common import load_app
from kafka_idem.codecs.avro_codec import AvroCodec
from kafka_idem.errors import ConfigError

MODULE = '''\
from kafka_idem import App

app = App("shop")
admin_app = App("shop-admin")
helper = len
count = 3
'''


@pytest.fixture
def module(tmp_path: Path) -> Iterator[str]:
    name = f"user_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    sys.path.insert(0, str(tmp_path))
    yield name
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def test_an_attribute_the_module_lacks_is_named_with_the_apps_it_has(module: str) -> None:
    with pytest.raises(click.BadParameter) as caught:
        load_app(f"{module}:nope")
    assert caught.value.message == (
        f"module {module!r} has no attribute 'nope' (its App objects: {module}:admin_app, "
        f"{module}:app)")


def test_an_attribute_that_is_not_an_app_says_what_it_is(module: str) -> None:
    with pytest.raises(click.BadParameter) as caught:
        load_app(f"{module}:helper")
    assert caught.value.message.startswith(
        f"'{module}:helper' is a builtin_function_or_method, not a kafka_idem App (its App ")
    assert load_app(f"{module}:app").name == "shop"
    with pytest.raises(click.BadParameter) as caught:
        load_app(f"{module}:count")
    assert caught.value.message.startswith(f"'{module}:count' is an int, not a kafka_idem App")


def test_a_file_name_typed_for_the_module_says_to_use_the_module_name(module: str) -> None:
    with pytest.raises(click.BadParameter) as caught:
        load_app(f"{module}.py:app")
    assert caught.value.message.endswith(
        f"(MODULE is a module name, as for python -m: {module}:app)")


def test_a_missing_schemas_folder_is_said_to_be_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        AvroCodec.from_dir(tmp_path / "nope")
    assert str(caught.value) == (
        f"schemas folder '{tmp_path / 'nope'}' does not exist: set KAFKA_IDEM_SCHEMAS_DIR to "
        "the folder of the .avsc files (setting=schemas_dir)")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"'.*file' is not a folder"):
        AvroCodec.from_dir(tmp_path / "file")


def test_a_module_that_fails_on_import_is_named_with_its_line(tmp_path: Path) -> None:
    name = f"user_app_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text("from kafka_idem import App\n\napp = App('shop')\n\n\n"
                    "@app.handler(topic='t', key='{id}')\ndef handle(msg, ctx):\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(click.BadParameter) as caught:
            load_app(f"{name}:app")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
    assert caught.value.message == (
        f"importing {name!r} failed at {path}:6: TypeError: App.handler() missing 1 required "
        "keyword-only argument: 'hash_fields'")


def _stderr_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from kafka_idem.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    code = exited.value.code
    assert isinstance(code, int)
    return code, capsys.readouterr().err


def test_a_wrong_module_app_is_one_error_line_naming_the_argument(
        module: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _stderr_of(["run", f"{module}:nope"], capsys)
    assert (code, err) == (2, (
        f"error: Invalid value for 'MODULE:APP': module {module!r} has no attribute 'nope' "
        f"(its App objects: {module}:admin_app, {module}:app)\n"))


def test_a_missing_argument_or_option_is_one_line_naming_the_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert _stderr_of(["run"], capsys) == (
        2, "error: Missing argument 'MODULE:APP'. (see 'kafka-idem run --help')\n")
    assert _stderr_of(["status", "--bogus"], capsys) == (
        2, "error: No such option '--bogus'. (see 'kafka-idem status --help')\n")
