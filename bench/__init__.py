"""Benchmarks for kafka_idem: ``python -m bench`` (see bench/README.md)."""
