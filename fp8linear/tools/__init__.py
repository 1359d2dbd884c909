"""Tools around the package: `fp8linear bench`, `tune`, `amd-check`, `plan-memory`, `demo`, and their
shape lists and timers. Nothing on the forward path imports this package."""
