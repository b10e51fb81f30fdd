"""kvd_client: the client library of the kvd KV-cache daemon."""

__all__ = ["__version__"]

__version__ = "0.1.0"
