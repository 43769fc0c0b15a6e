"""What vLLM's prefix cache keys a request's blocks on, read from vLLM's
``Request`` and config into our own records (planning/isolation.py,
planning/identity.py decide what to do with them).

Read from vLLM 0.32's ``vllm/v1/core/kv_cache_utils.py``,
``generate_block_hash_extra_keys``: the LoRA adapter (name and path), every
multimodal item overlapping a block (``mm_features[i].identifier`` and its
``mm_position``), the ``cache_salt`` and a hash of the prompt embeddings.
Every supported vLLM (0.23 ... 0.32) has these ``Request`` attributes. A
request carrying something this module cannot turn into key tokens is
refused (neither looked up nor stored) with a :class:`Refusal`: vLLM would
key on it, so serving it by token ids alone could serve wrong KV.

Kept apart from the other vllm_* readers (vllm_specs, vllm_kv_layout,
vllm_step_view, vllm_engine_config) so each stays under 600 lines; each
reads vLLM's objects only through attributes it names.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from lmcache_ascend.planning.identity import IdentityError, ModelFacts, lora_fingerprint
from lmcache_ascend.planning.isolation import (
    LoraIdentity,
    MultimodalItem,
    Refusal,
    RequestKeys,
    key_tokens,
)

if TYPE_CHECKING:
    # Named for readers; mypy skips vLLM's sources, so to it these stay untyped.
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Longest cache_salt accepted. vLLM takes any string; one of megabytes would
# only cost hashing time, but is no salt an operator sets on purpose.
MAX_SALT_CHARS = 4096


@dataclass(frozen=True)
class RequestView:
    """What the scheduler half reads from a vLLM ``Request``."""

    req_id: str
    # Live view: prompt + generated tokens, as LMCache keys them (isolation
    # tokens where the request has extra keys; planning/isolation.py).
    token_ids: Sequence[int]
    num_tokens: int
    num_prompt_tokens: int
    # Set when the request must be neither looked up nor stored.
    refusal: Optional[Refusal] = None


# The probes below are duck-typed on purpose: every supported vLLM
# (0.23-0.32) has these fields (Request's prompt_embeds, cache_salt,
# lora_request, mm_features; LoRARequest's lora_name, lora_path; each
# mm_features item's identifier, mm_hash, mm_position), but a request
# missing one is refused or read as not having it, never an AttributeError.
def request_keys(request: Request) -> tuple[RequestKeys, Optional[Refusal]]:
    """The extra keys of ``request``, or why it cannot be keyed."""
    if getattr(request, "prompt_embeds", None) is not None:
        return RequestKeys(), Refusal(
            "prompt_embeds", "the request gives prompt embeddings, which chunk keys do not cover"
        )
    salt = getattr(request, "cache_salt", None)
    if salt is not None and not isinstance(salt, str):
        return RequestKeys(), Refusal("cache_salt", f"cache_salt of type {type(salt).__name__}; valid: a string")
    if salt is not None and len(salt) > MAX_SALT_CHARS:
        return RequestKeys(), Refusal(
            "cache_salt", f"cache_salt of {len(salt)} characters; valid: at most {MAX_SALT_CHARS}"
        )
    lora = None
    lora_request = getattr(request, "lora_request", None)
    if lora_request is not None:
        name = str(getattr(lora_request, "lora_name", "") or "")
        path = str(getattr(lora_request, "lora_path", "") or "")
        try:
            lora = LoraIdentity(name, lora_fingerprint(path))
        except IdentityError as e:
            return RequestKeys(), Refusal("lora", f"LoRA adapter {name!r}: {e}")
    items: list[MultimodalItem] = []
    if not hasattr(request, "mm_features"):
        return RequestKeys(), Refusal("multimodal", "this vLLM's Request has no mm_features")
    for feature in request.mm_features or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        # Any: vLLM's PlaceholderRange or None (then AttributeError below, a refusal).
        pos: Any = getattr(feature, "mm_position", None)
        try:
            items.append(MultimodalItem(str(ident or ""), int(pos.offset), int(pos.length)))
        except (AttributeError, TypeError, ValueError) as e:
            return RequestKeys(), Refusal("multimodal", f"multimodal item {ident!r}: {e}")
    return RequestKeys(cache_salt=salt or None, lora=lora, mm_items=tuple(items)), None


def request_view(request: Request, refusal: Optional[Refusal] = None) -> RequestView:
    """``refusal``: one that holds for every request (the model's identity
    is unknown, say); the request's own is checked first."""
    keys, own = request_keys(request)
    num_prompt = int(request.num_prompt_tokens)
    tokens = request.all_token_ids
    return RequestView(
        req_id=request.request_id,
        token_ids=tokens if (own or refusal) else key_tokens(tokens, num_prompt, keys),
        num_tokens=int(request.num_tokens),
        num_prompt_tokens=num_prompt,
        refusal=own or refusal,
    )


# ---- the model's identity -------------------------------------------------


def _hf_config_digest(model_config: ModelConfig) -> str:
    # Duck-typed, as model_facts' probes: ModelConfig has hf_config, dtype,
    # quantization and revision (CacheConfig cache_dtype) on 0.23-0.32.
    cfg = getattr(model_config, "hf_config", None)
    text = None
    if cfg is not None:
        try:
            text = cfg.to_json_string(use_diff=False)
        except Exception:  # noqa: BLE001 - any config object: fall back to its dict
            text = json.dumps(getattr(cfg, "__dict__", {}), sort_keys=True, default=str)
    return hashlib.sha256((text or "").encode()).hexdigest()[:16]


def model_facts(vllm_config: VllmConfig, explicit: Optional[str] = None) -> ModelFacts:
    """What determines this engine's KV besides the tokens: the checkpoint
    (its local directory), its dtype, KV cache dtype, quantization and the
    HF config vLLM built the model from. Nothing that differs between TP
    ranks or TP sizes (replicated chunks are shared across them)."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    settings = {
        "dtype": str(getattr(mc, "dtype", "")),
        "kv_cache_dtype": str(getattr(cc, "cache_dtype", "")),
        "quantization": str(getattr(mc, "quantization", None)),
        "hf_config": _hf_config_digest(mc),
        "revision": str(getattr(mc, "revision", None)),
    }
    path = _local_dir(str(mc.model), getattr(mc, "revision", None))
    return ModelFacts(name=str(mc.model), path=path, revision=getattr(mc, "revision", None),
                      settings=settings, explicit=explicit)


def _local_dir(model: str, revision: Optional[str]) -> Optional[str]:
    """The directory holding the checkpoint: ``model`` itself, or its
    snapshot in the Hugging Face cache (already downloaded by vLLM)."""
    import os

    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - not cached / not a hub id: unknown
        logger.debug("lmcache-ascend: no local snapshot of %r: %s", model, e)
        return None
