"""The `rlfleet` command line."""
