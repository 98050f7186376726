"""Generated code of protos/gateway/admin/v1 (scripts/gen_protos.py writes it; do not edit)."""
