"""The parts of scripts/gen_docs.py: the configuration table (`config_keys`, with what the
schema does not say in `config_facts`), the metrics table (`metrics_table`) and the
generated blocks in their docs (`blocks`)."""
