"""``python -m kafka_idem.cli``: the ``kafka-idem`` command, where the console script
is not installed (the members the tests, benchmarks and ``verify`` start)."""

from kafka_idem.cli import main

main()
