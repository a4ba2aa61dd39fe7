"""The local stack for demos, tests and benchmarks (not used by the service)."""
