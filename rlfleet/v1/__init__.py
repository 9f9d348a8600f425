"""Generated protobuf and gRPC code for proto/rlfleet/v1 (see scripts/gen_protos.py)."""
