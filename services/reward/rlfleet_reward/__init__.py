"""rlfleet reward hub: named reward functions behind one scoring core."""
