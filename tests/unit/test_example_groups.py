"""The example apps take their consumer group from KAFKA_IDEM_GROUP_ID (a group id set
in code would win over the environment), else from their name."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from consumers import gateway, payments
from kafka_idem import App


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KAFKA_IDEM_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("build", "default"), [(payments.build_app, "payments"),
                                                (gateway.build_app, "gateway")])
def test_the_environment_chooses_the_group(
    monkeypatch: pytest.MonkeyPatch, build: Callable[..., App], default: str
) -> None:
    assert build().group_id == default
    monkeypatch.setenv("KAFKA_IDEM_GROUP_ID", "payments-blue")
    assert build().group_id == "payments-blue"
    assert build(group_id="explicit").group_id == "explicit"  # an argument still wins


def test_the_module_level_app_reads_the_environment_when_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAFKA_IDEM_GROUP_ID", "payments-green")
    app = payments.build_app()  # what `kafka-idem run consumers.payments:app` imports
    app.configure()  # the CLI without --group-id
    assert app.group_id == "payments-green"
