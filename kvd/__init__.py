"""kvd: a node-local KV-cache daemon for LLM inference."""

__all__ = ["__version__"]

__version__ = "0.1.0"
