"""A stand-in Kubernetes API server for tests (pods only; see apiserver.py)."""
