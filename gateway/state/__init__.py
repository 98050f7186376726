"""State every replica shares through a store (Redis or Valkey): tenants' budgets, model
aliases' routes and session bindings. Each part falls back to the serving process's own
state while the store is away, and writes back or re-reads once it returns."""
