"""The ``kafka-idem`` command line: :func:`main` is its console script (and
``python -m kafka_idem.cli``'s).

:mod:`~kafka_idem.cli.commands` holds the group and the member's commands (``migrate``,
``run``, ``relay``) and registers the others; one module per group of sub-commands
(:mod:`~kafka_idem.cli.admin`: ``status``, ``inspect``, ``rerun``;
:mod:`~kafka_idem.cli.purge`; :mod:`~kafka_idem.cli.dlq`: ``dlq list``, ``dlq show``;
:mod:`~kafka_idem.cli.dlq_replay`: ``dlq replay``; :mod:`~kafka_idem.cli.pause`:
``pause``, ``resume``; :mod:`~kafka_idem.cli.topics`;
:mod:`~kafka_idem.cli.verify`), all over :mod:`~kafka_idem.cli.common` (loading an app,
the context object, the shared options and connections),
:mod:`~kafka_idem.cli.errors` (exit codes, one-line errors) and the output helpers
(:mod:`~kafka_idem.cli.table`, :mod:`kafka_idem.observe.text`). The sub-command modules
import none of one another, nor :mod:`~kafka_idem.cli.commands`.
"""

from kafka_idem.cli.commands import main

__all__ = ["main"]
