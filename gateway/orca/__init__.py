"""ORCA load reports of this serving process, for meshes that balance gateway replicas by
load: the report (report.py) goes on every engine call's trailers (proxy/reporting.py)
and on `OpenRcaService/StreamCoreMetrics` streams (service.py). v3/ is generated from
protos/xds (the upstream xDS ORCA protos' names and numbers)."""
