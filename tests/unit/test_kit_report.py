"""The check report groups identical differences (kafka_idem.testing.report): a defect
seen in N scenarios is said once, naming the N scenarios, before anything else."""

from __future__ import annotations

from kafka_idem.testing.report import CheckReport, Fault, ScenarioResult, differences

EXTRA_ROW = ("table shop.orders: 1 row(s) more than the reference\n"
             "  extra   {key: 't1:order:o-1', amount: 12.50, note: 'a, b: {c}'}")


def scenario(name: str, path: str, *problems: str) -> ScenarioResult:
    r = ScenarioResult(name, f"the {name} scenario", path, story=[f"{name} ran"])
    for p in problems:
        r.wrong(p)
    return r


def event(event_id: str, n: int = 1) -> str:
    return ("events to shop.placed: 1 event(s), the reference has 1\n"
            f"  missing key 'o-1': {{order_id: 'o-1', n: 1, event_id: 'ref'}}\n"
            f"  extra   key 'o-1': {{order_id: 'o-1', n: {n}, event_id: '{event_id}'}}")


def report(*results: ScenarioResult) -> CheckReport:
    return CheckReport(handler="place", topic="shop.orders", mode="local",
                       tables=["shop.orders"], left_out=[], remotes=[],
                       reference=["delivered once"], results=list(results))


def test_a_defect_seen_in_n_scenarios_is_reported_once_naming_them() -> None:
    results = [scenario("twice", "per-message", EXTRA_ROW),
               scenario("crash_before_commit", "per-message", EXTRA_ROW),
               scenario("crash_before_commit", "batch", EXTRA_ROW),
               scenario("conflict", "batch"),
               scenario("concurrent", "batch", "the outcomes were succeeded x2")]
    [row, outcomes] = differences([r for r in results if not r.passed])
    assert row.text == EXTRA_ROW
    assert row.scenarios == ["twice [per-message]", "crash_before_commit [per-message]",
                             "crash_before_commit [batch]"]
    assert outcomes.scenarios == ["concurrent [batch]"]
    text = str(report(*results))
    lines = text.splitlines()
    assert lines[0].startswith("kafka_idem check of handler 'place' (topic shop.orders, local "
                               "mode): 4 of 5 scenarios FAILED")
    # what differs, then where, first; the context after
    assert lines[1:6] == [
        "  ! 1. table shop.orders: 1 row(s) more than the reference",
        "        extra   {key: 't1:order:o-1', amount: 12.50, note: 'a, b: {c}'}",
        "    in 3 scenarios: twice [per-message], crash_before_commit [per-message], "
        "crash_before_commit [batch]",
        "  ! 2. the outcomes were succeeded x2",
        "    in 1 scenario: concurrent [batch]",
    ]
    assert lines[6] == "  compared: shop.orders"
    assert text.count("extra   {key: 't1:order:o-1'") == 1
    # each scenario keeps its story and names the difference in one line
    assert text.count("  ! table shop.orders: 1 row(s) more than the reference  "
                      "(difference 1 above)") == 3
    assert "FAILED   twice [per-message]: the twice scenario\n    twice ran\n  ! table" in text
    assert "  ! the outcomes were succeeded x2  (difference 2 above)" in text
    assert "passed   conflict [batch]: the conflict scenario" in text
    # the scenario's own view is whole
    assert results[0].lines()[-1] == (
        "        extra   {key: 't1:order:o-1', amount: 12.50, note: 'a, b: {c}'}")


def test_a_value_new_in_every_scenario_is_one_difference_and_marked() -> None:
    found = differences([scenario("twice", "batch", event("aa11", 2)),
                         scenario("crash_before_commit", "batch", event("bb22", 3)),
                         scenario("concurrent", "batch", event("cc33", 4))])
    [d] = found
    assert d.scenarios == ["twice [batch]", "crash_before_commit [batch]",
                           "concurrent [batch]"]
    assert d.text.splitlines()[1:] == [
        "  missing key 'o-1': {order_id: 'o-1', n: 1, event_id: 'ref'}",
        "  extra   key 'o-1': {order_id: 'o-1', n: <a different value in each scenario: 2, "
        "3, ...>, event_id: <a different value in each scenario: 'aa11', 'bb22', ...>}"]


def test_values_some_scenarios_share_keep_their_differences_apart() -> None:
    # n is 2 in two scenarios and 5 in a third: not a value made anew in each run
    found = differences([scenario("twice", "batch", event("x", 2)),
                         scenario("crash_before_commit", "batch", event("x", 2)),
                         scenario("retries_exhausted", "batch", event("x", 5))])
    assert [(d.scenarios, "n: 5" in d.text) for d in found] == [
        (["twice [batch]", "crash_before_commit [batch]"], False),
        (["retries_exhausted [batch]"], True)]
    assert all("<a different value" not in d.text for d in found)


def test_the_most_widespread_difference_comes_first() -> None:
    found = differences([scenario("once", "batch", "outcome: conflict, expected succeeded"),
                         scenario("twice", "batch", EXTRA_ROW),
                         scenario("crash_before_commit", "batch", EXTRA_ROW)])
    assert [d.scenarios for d in found] == [
        ["twice [batch]", "crash_before_commit [batch]"], ["once [batch]"]]


def test_a_reference_that_did_not_succeed_is_said_in_the_headline() -> None:
    ok = report(scenario("twice", "leased"), scenario("concurrent", "leased"))
    assert ok.reference_succeeded
    assert str(ok).splitlines()[0].startswith(
        "kafka_idem check of handler 'place' (topic shop.orders, local mode): "
        "all 2 scenarios passed in ")
    agreed = report(scenario("twice", "leased"), scenario("concurrent", "leased"))
    agreed.reference_outcome = "dead_lettered (permanent)"
    assert agreed.passed and not agreed.reference_succeeded
    assert str(agreed).splitlines()[0].startswith(
        "kafka_idem check of handler 'place' (topic shop.orders, local mode): the reference "
        "delivery did not succeed (dead_lettered (permanent)); 2 scenarios agree with it in ")
    differ = report(scenario("twice", "leased", "the second delivery: succeeded"),
                    scenario("concurrent", "leased"))
    differ.reference_outcome = "dead_lettered (exhausted)"
    assert str(differ).splitlines()[0].startswith(
        "kafka_idem check of handler 'place' (topic shop.orders, local mode): the reference "
        "delivery did not succeed (dead_lettered (exhausted)); 1 of 2 scenarios FAILED in ")


def test_a_fault_of_the_check_fails_it_first_whatever_the_scenarios_say() -> None:
    leak = Fault("a value made by an SQLAlchemy client-side default leaves the transaction",
                 ["shop.orders.ref is made by ... in event shop.placed field ref",
                  "  fix: derive it from the idempotency key"])
    r = report(scenario("twice", "batch", EXTRA_ROW), scenario("concurrent", "batch"))
    r.faults.append(leak)
    lines = str(r).splitlines()
    assert not r.passed
    assert lines[0].split(": ", 1)[1].startswith(
        "FAILED: a value made by an SQLAlchemy client-side default leaves the transaction; "
        "1 of 2 scenarios FAILED in ")
    assert lines[1:4] == ["  ! shop.orders.ref is made by ... in event shop.placed field ref",
                          "      fix: derive it from the idempotency key",
                          "  ! 1. table shop.orders: 1 row(s) more than the reference"]
    clean = report(scenario("twice", "batch"))
    clean.faults.append(leak)
    assert not clean.passed and "all 1 scenarios passed in " in str(clean).splitlines()[0]
    # a fault that says why the reference failed replaces "did not succeed"
    defect = report(scenario("twice", "leased"))
    defect.reference_outcome = "dead_lettered (permanent)"
    defect.faults.append(Fault("the reference delivery failed with a code defect "
                               "(dead_lettered (permanent): TypeError)",
                               ["the reference delivery failed: TypeError: ..."],
                               about_reference=True))
    assert str(defect).splitlines()[0].split(": ", 1)[1].startswith(
        "FAILED: the reference delivery failed with a code defect (dead_lettered "
        "(permanent): TypeError); 1 scenarios agree with it in ")
