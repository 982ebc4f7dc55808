"""Repository tools, not part of the kafka_idem wheel: the chaos run (:mod:`tools.chaos`)
and what it shares with the demo and the benchmarks (:mod:`tools.kafka_state`, a topic's
records and a group's committed offsets, read without joining the group).

Run them from the checkout's root (``python -m tools.chaos.run``), where ``consumers``
and ``bench`` are importable too.
"""
