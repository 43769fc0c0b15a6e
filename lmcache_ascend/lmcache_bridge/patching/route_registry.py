"""The vLLM-facing steps of the LMCacheConnectorV1 route, registered from above.

``adapter_shim`` patches LMCache's vLLM adapter, but the steps of that route
that read vLLM's types or build the transfer plan belong to the vLLM
integration layer (``lmcache_ascend.integration.vllm.adapter_route``), which
the bridge must not import. That layer hands them over as one
:class:`AdapterRoute`; its ``install`` registers it before it installs the
import hook, so the route is there whenever the patch is.

Imports neither LMCache, vLLM nor torch: registering costs nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional


@dataclass(frozen=True)
class AdapterRoute:
    # Startup checks and the vLLM settings the route needs, in both roles:
    # (LMCache's engine config, vLLM's config, whether this is the scheduler).
    prepare: Callable[[Any, Any, bool], None]
    # Where vLLM never shuts its connector down, make its shutdown close
    # LMCache's engine: (vLLM's connector or None, the close to call).
    install_shutdown: Callable[[Any, Callable[[], None]], None]
    # Plan the transfers for vLLM's KV tensors and bind the engine's chunk
    # connector: (vLLM's connector, LMCache's engine, LMCache's config, kv_caches).
    bind: Callable[[Any, Any, Any, Mapping[str, Any]], None]
    # Why a request must be neither looked up nor stored by this route (its
    # keys cannot cover what vLLM's prefix cache keys the request on), as
    # (kind, detail), or None: (vLLM's Request).
    refusal: Callable[[Any], Optional[tuple[str, str]]] = lambda request: None


class RouteNotRegistered(RuntimeError):
    """LMCache's adapter was patched in a process where no route was registered."""


_lock = threading.Lock()
_route: Optional[AdapterRoute] = None


def register(route: AdapterRoute) -> None:
    """Idempotent; a later registration replaces an earlier one."""
    global _route
    with _lock:
        _route = route


def registered() -> AdapterRoute:
    with _lock:
        route = _route
    if route is None:
        raise RouteNotRegistered(
            "lmcache-ascend: LMCache's vLLM adapter is patched but its vLLM steps are not "
            "registered in this process; call lmcache_ascend.integration.vllm.adapter_route.install() "
            "(this package's vLLM plugin does, unless VLLM_PLUGINS leaves it out) before vLLM builds "
            "LMCacheConnectorV1"
        )
    return route
