"""Where the message path used to live; it is in :mod:`kafka_idem.consume` now.

Kept so that ``from kafka_idem.processing import Processor, Finished, Deferred,
Result`` goes on working for the runner, the tests and user code.
"""

from kafka_idem.consume.executor import Processor
from kafka_idem.consume.outcome import Deferred, Ended, Finished, Message, Prepared, Reason, Result
from kafka_idem.consume.steps import context as make_context

__all__ = [
    "Deferred",
    "Ended",
    "Finished",
    "Message",
    "Prepared",
    "Processor",
    "Reason",
    "Result",
    "make_context",
]
