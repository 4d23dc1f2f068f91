"""Command-line tools: export, serve, demo, client. Run them as ``python -m scripts.<name>``."""
