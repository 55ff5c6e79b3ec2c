"""specdec: the shared core of distributed speculative decoding (no network code)."""

__version__ = "0.1.0"
