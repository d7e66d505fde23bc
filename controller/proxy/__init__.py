"""kvfleet proxy: OpenAI-compatible /v1/completions and /v1/chat/completions in front of a vLLM fleet.

Each request is tokenized as its worker would, routed by the controller (with the client's own
bearer token, so auth and the tenant's cache_salt are the controller's), forwarded with that
cache_salt, and relayed back byte for byte. See docs/proxy.md.
"""

from __future__ import annotations

from controller.proxy.config import ProxyConfig
from controller.proxy.server import Proxy

__all__ = ["Proxy", "ProxyConfig"]
