"""rlfleet shared library: contracts, the sample stream, errors, settings, logging and the CLI."""

__version__ = "0.1.0"
