"""Tools kept apart from the forward path: benchmarks, tuning, checks. Nothing under
``fp8linear`` that a forward call runs imports this package."""
