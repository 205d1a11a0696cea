"""Can the Hugging Face hub be reached, asked once with a short connect before a hub id that is
not in the hub cache is loaded: unreachable, the load is refused at once, not after the hub
client's retries (about 50 s with no network). Owns no download and no engine code.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

CONNECT_TIMEOUT = 5.0  # seconds: a reachable hub accepts a TCP connection well within this
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
TRUE = ("1", "true", "yes", "on")


def hub_unreachable(timeout: float = CONNECT_TIMEOUT) -> str | None:
    """Why the hub cannot be reached right now, or None (reachable, or not knowable from here:
    behind a proxy the direct connection says nothing)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in PROXY_VARS):
        return None
    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT  # what the hub client will call (HF_ENDPOINT, read at its import)
    except ImportError:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlsplit(endpoint)
    if not url.hostname:
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as exc:
        return f"cannot connect to {url.hostname}:{port} ({exc.strerror or type(exc).__name__})"
    return None


__all__ = ["hub_unreachable"]
