"""Command-line tools: ``python -m tools.check_dataset``, ``python -m tools.import_dataset``."""
