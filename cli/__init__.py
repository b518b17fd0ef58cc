"""Command-line interface (installed as `lookahead.cli`)."""
