"""The shared claim of a key-ordered dispatch round (:mod:`kafka_idem.consume.paths.round_claim`):
who sends it, what a job that will not start may withdraw, what a failure means. No
database: the claim is a stub that records what it was asked."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future

from kafka_idem.consume.paths.round_claim import RoundClaim, Tokens, Wanted
from kafka_idem.store import Delivery


def wanted(key: str, offset: int) -> Wanted:
    return Wanted(key, "h", Delivery("t", 0, offset, "h"))


def test_the_first_job_sends_the_claim_once_and_every_job_reads_its_answer() -> None:
    round_ = RoundClaim([wanted("a", 0), wanted("b", 1)])
    asked: list[list[str]] = []
    tokens = {"a": uuid.uuid4()}  # b existed: no token

    def run(todo: list[Wanted]) -> Tokens:
        asked.append([w.key for w in todo])
        return tokens

    got = [round_.tokens(run) for _ in range(3)]
    assert asked == [["a", "b"]] and got == [tokens] * 3


def test_only_the_message_it_was_built_for_is_covered() -> None:
    round_ = RoundClaim([wanted("a", 0)])
    assert round_.covers("a", Delivery("t", 0, 0, "h"))
    assert not round_.covers("a", Delivery("t", 1, 0, "h"))  # the same key elsewhere
    assert not round_.covers("b", Delivery("t", 0, 1, "h"))


def test_a_job_that_will_not_start_withdraws_its_key_only_before_the_claim_is_sent() -> None:
    round_ = RoundClaim([wanted("a", 0), wanted("b", 1), wanted("c", 2)])
    assert round_.withdraw("a", Delivery("t", 0, 0, "h"))  # not sent yet: out
    asked: list[list[str]] = []
    round_.tokens(lambda todo: asked.append([w.key for w in todo]) or {})
    assert asked == [["b", "c"]]
    assert not round_.withdraw("b", Delivery("t", 0, 1, "h"))  # sent: the job must run
    assert round_.withdraw("z", Delivery("t", 0, 9, "h"))  # never in the round


def test_a_failed_claim_leaves_every_job_to_claim_alone() -> None:
    round_ = RoundClaim([wanted("a", 0), wanted("b", 1)])

    def run(todo: list[Wanted]) -> Tokens:
        raise RuntimeError("connection lost")

    assert round_.tokens(run) is None
    assert round_.tokens(run) is None


def test_a_claim_sent_elsewhere_survives_a_waiter_giving_up() -> None:
    round_ = RoundClaim([wanted("a", 0), wanted("b", 1)])
    sent: Future[Tokens] = Future()
    submits: list[list[str]] = []

    def submit(todo: list[Wanted]) -> Future[Tokens]:
        submits.append([w.key for w in todo])
        return sent

    first = round_.future(submit)
    assert round_.future(submit) is first and submits == [["a", "b"]]
    assert not first.cancel()  # a cancelled task's waiter cannot end it for the others
    token = uuid.uuid4()
    threading.Thread(target=lambda: sent.set_result({"a": token})).start()
    assert first.result(5) == {"a": token}
