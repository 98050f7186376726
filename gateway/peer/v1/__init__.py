"""Generated code of protos/gateway/peer/v1 (scripts/gen_protos.py writes it; do not edit)."""
