"""The package's version: the one place it is written (pyproject.toml reads it from here,
``kafka_idem.__version__`` and ``kafka-idem --version`` print it). docs/versioning.md says
when it changes and how a release is made."""

__version__ = "0.2.0"
