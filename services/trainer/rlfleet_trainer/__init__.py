"""rlfleet trainer: the policy, its optimizer and its weight versions."""
