"""The gateway's admin API: a gRPC service on its own port to change and watch the fleet."""
