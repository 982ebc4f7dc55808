"""The version policy held by the code (docs/versioning.md): a deprecated metric says, in
its own HELP text, the release that removes it; that release is a later minor one; and
CHANGELOG.md's Deprecated section names the metric and the same release."""

from __future__ import annotations

import re

import kafka_idem
from kafka_idem.observe.metrics import METRICS
from tests.conftest import ROOT
from tools.changelog_check import semver_key

REMOVED_IN = re.compile(r"DEPRECATED \(removed in (\d+\.\d+\.\d+)\)")


def deprecated_section_lines() -> str:
    text = (ROOT / "CHANGELOG.md").read_text()
    sections = re.findall(r"^### Deprecated\n(.*?)(?=^##)", text + "\n##", re.S | re.M)
    return "\n".join(sections).replace("\n  ", " ")


def test_every_deprecated_metric_names_its_removal_release() -> None:
    deprecated = {name: help_text for _, _, name, help_text, _ in METRICS
                  if "deprecated" in help_text.lower()}
    assert set(deprecated) == {"kafka_idem_duplicate_ratio"}
    current = semver_key(kafka_idem.__version__)
    changelog = deprecated_section_lines()
    for name, help_text in deprecated.items():
        match = REMOVED_IN.search(help_text)
        assert match, f"{name}: its HELP text names no release that removes it"
        removal = match.group(1)
        assert semver_key(removal)[:2] > current[:2], (name, removal, "not a later minor")
        line = next((ln for ln in changelog.splitlines() if f"`{name}`" in ln), "")
        assert removal in line, f"CHANGELOG.md's Deprecated names {name} with {removal}"
