"""Generated code of protos/envoy/, the part of Envoy's external processing protocol the
endpoint picker speaks (scripts/gen_protos.py writes it, moved here from a top-level
`envoy`; do not edit)."""
