"""The Hugging Face hub from a machine that may not reach it (foxlm's machines reach only package registries).

huggingface_hub and ``datasets`` read ``HF_HUB_OFFLINE`` once, when imported, and otherwise retry each file five
times before giving up; one request made first finds out at once.
"""

from __future__ import annotations

import os


def hub_offline() -> bool:
    """Whether the Hugging Face hub is off for this process (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` set, as
    huggingface_hub and datasets read them)."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether ``HF_ENDPOINT`` (default https://huggingface.co) answers a HEAD request at all (any HTTP status),
    through the environment's proxies: one request, where huggingface_hub would retry each file five times."""
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # an answer, if not a 200
    except (urllib.error.URLError, OSError, ValueError):  # no route, no name, refused, timed out; a bad endpoint
        return False
    return True


def offline_unless_reachable() -> bool:
    """Switch this process (and its children) to the hub's offline mode where the hub cannot be reached; returns
    whether it did. Effective only before huggingface_hub and datasets are imported."""
    if hub_offline() or hub_reachable():
        return False
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    return True
