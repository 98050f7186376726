"""The standard gRPC health service's methods (grpc.health.v1), named once: the gateway
serves them, asks its workers through them, and opens them to callers without a key."""

from __future__ import annotations

CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
