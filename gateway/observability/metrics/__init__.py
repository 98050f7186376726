"""Prometheus metrics of what a call's record and the process say: per-call counters
fed by each call's record (`calls`), counts kept elsewhere (`counts`: spans, metadata not
relayed, migration's kept tokens), the process's resources and build (`process`). Per
call, `observe` costs a few dict lookups: label children are cached, so the hot path never
re-validates labels.

The collectors of what other parts hold sit beside them, read at scrape time in the HTTP
server's thread (copying what they read, never changing it): the fleet's
(`upstream/metrics.py`, `upstream/lora_metrics.py`, `upstream/load/kv_metrics.py`),
flow control's (`flow/metrics.py`), session affinity's (`placement/metrics.py`),
discovery's (`discovery/metrics.py`); `app/metrics.py` holds them all in one registry and
serves /metrics.
"""
