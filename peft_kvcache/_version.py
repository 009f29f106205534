"""The version of peft-kvcache (read by pyproject.toml and recorded in every map)."""

__version__ = "0.2.0"
