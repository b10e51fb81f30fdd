"""Integrations of kvd with inference code: paged attention in torch, a transformers cache.

Each submodule imports its framework (torch, transformers) at import time;
``import kvd_client`` never does. Import the one you need:
``from kvd_client.integrations.paged import paged_attention`` or
``from kvd_client.integrations.hf import KvdCache``.
"""

__all__: list[str] = []
