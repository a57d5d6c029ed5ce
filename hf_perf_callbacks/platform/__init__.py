"""One door each to what lies outside the package: the accelerator (device.py), the private attributes of transformers,
TRL, accelerate and torch (adapter.py), macOS memory pressure (macos.py)."""
