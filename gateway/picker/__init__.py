"""The endpoint picker: the gateway's placement for an Envoy that relays the calls itself
(Envoy's external processing protocol, as the Gateway API Inference Extension uses it)."""
