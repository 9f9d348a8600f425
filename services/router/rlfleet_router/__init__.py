"""rlfleet router: membership, health, routing and weight versions of the inference fleet."""
