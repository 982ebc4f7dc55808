"""``inspect``'s suggestions: the escaped forms a template could have stored."""

from __future__ import annotations

from kafka_idem.admin.operations import escaped_forms
from kafka_idem.keys import KeyTemplate


def test_the_key_a_template_built_is_among_the_forms_of_its_values_typed_plainly() -> None:
    template = KeyTemplate("{tenant}:email-sync:{email_id}")
    stored = template.build({"tenant": "t:1", "email_id": "h-perm%-0"})
    typed = "t:1:email-sync:h-perm%-0"
    assert stored != typed
    assert stored in escaped_forms(typed)
    assert typed not in escaped_forms(typed)


def test_the_forms_are_bounded_however_many_separators_the_key_has() -> None:
    assert len(escaped_forms("a:" * 40)) < 2 ** 11
    assert escaped_forms("plain") == []
