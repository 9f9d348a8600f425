"""rlfleet rollout orchestrator: owns runs (specs, state, data position) and writes their sample streams."""
