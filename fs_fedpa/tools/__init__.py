"""Command-line helpers (``python -m fs_fedpa.tools.<name>``)."""
