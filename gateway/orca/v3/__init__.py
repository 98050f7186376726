"""Generated code of protos/xds/data/orca/v3 and protos/xds/service/orca/v3, the ORCA protos
(scripts/gen_protos.py writes it, moved here from a top-level `xds`; do not edit)."""
