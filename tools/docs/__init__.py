"""The docs site's generated pages (``python -m tools.docs.reference``): the reference
section, written from the code (settings, CLI, metrics, headers, the Python API)."""
