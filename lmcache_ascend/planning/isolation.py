"""What a chunk key covers besides the prompt's token ids.

vLLM's own prefix cache keys a block by its tokens *and* the request's extra
keys (vllm/v1/core/kv_cache_utils.py, ``generate_block_hash_extra_keys``):
the LoRA adapter, every multimodal item overlapping the block (its content
hash and offset), the ``cache_salt`` (first block only; the hash chain
carries it on) and prompt embeddings. A connector that keys by token ids
alone serves one tenant's KV to another, a LoRA's KV to the base model and
one image's KV to a request with another image at the same placeholders.

LMCache keys a chunk by a hash chained over the token ids of every chunk up
to it, and its lookup protocol carries token ids only. So the extra keys go
into the token ids LMCache sees (the *key tokens*), not beside them:

* every position of a multimodal item's placeholder range holds an
  *isolation token* derived from (the item's content hash, the position's
  index inside the item) instead of the placeholder id, which is the same
  for every image; a prefix that ends before the first item keeps its
  tokens and still hits across requests with other items, as in vLLM;
* position 0 holds an isolation token derived from (the cache salt, the
  LoRA adapter's name and weight fingerprint, the token there), each in its
  own tagged, length-prefixed field: a salt can never collide with an
  adapter name, and any chunk key of a salted request differs from an
  unsalted one because the chain starts differently.

Isolation tokens are at most ``ISOLATION_CEILING`` (-2**32): no real token
is negative and the Mamba snapshot marks (planning/state_align.py) lie
above -2**17, so neither can equal one. A request with none of these extra
keys keeps its token ids unchanged, and so its chunk keys.

The token count never changes, so chunk boundaries, hit lengths and block
arithmetic are those of the plain prompt. Values are SHA-256 based: stable
across processes, machines and ``PYTHONHASHSEED``.

Pure: imports neither vLLM, LMCache nor the compiled ops.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union, overload

ISOLATION_CEILING = -(1 << 32)
# 60 bits of SHA-256 per isolation token: collisions between two requests'
# first tokens are as likely as guessing a 60-bit secret.
_VALUE_BITS = 60
_VERSION = b"lmca-isolation-v1"


def _field(tag: bytes, value: Union[str, bytes, int]) -> bytes:
    """One tagged, length-prefixed field: no choice of strings makes two
    field lists encode alike (a salt "x@y" is never a salt "x" plus more)."""
    if isinstance(value, int):
        data = value.to_bytes(16, "little", signed=True)
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
    else:
        data = bytes(value)
    return tag + len(data).to_bytes(8, "little") + data


def isolation_token(*fields: bytes) -> int:
    digest = hashlib.sha256(_VERSION + b"".join(fields)).digest()
    value = int.from_bytes(digest[:8], "little") & ((1 << _VALUE_BITS) - 1)
    return ISOLATION_CEILING - value


def is_isolation_token(token: int) -> bool:
    return token <= ISOLATION_CEILING


@dataclass(frozen=True)
class LoraIdentity:
    """A LoRA adapter as keys see it: its name and a fingerprint of its
    files (the name alone is not the same adapter on another instance)."""

    name: str
    fingerprint: str

    def __post_init__(self) -> None:
        if not self.fingerprint:
            raise ValueError(f"LoRA adapter {self.name!r}: empty weight fingerprint")


@dataclass(frozen=True)
class MultimodalItem:
    """One multimodal input: vLLM's content hash of it and its placeholder
    range in the prompt."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.identifier:
            raise ValueError(f"multimodal item at offset {self.offset}: empty content hash")
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"multimodal item {self.identifier!r}: placeholder range offset={self.offset} "
                f"length={self.length}; valid: offset >= 0, length > 0"
            )


@dataclass(frozen=True)
class RequestKeys:
    """Everything besides token ids that a request's chunk keys cover."""

    cache_salt: Optional[str] = None
    lora: Optional[LoraIdentity] = None
    mm_items: tuple[MultimodalItem, ...] = ()

    @property
    def plain(self) -> bool:
        return not self.cache_salt and self.lora is None and not self.mm_items

    def first_token_fields(self) -> list[bytes]:
        out = []
        if self.cache_salt:
            out.append(_field(b"salt", self.cache_salt))
        if self.lora is not None:
            out.append(_field(b"lora-name", self.lora.name))
            out.append(_field(b"lora-weights", self.lora.fingerprint))
        return out

    def overrides(self, num_prompt_tokens: int, first_token: Optional[int]) -> dict[int, int]:
        """Position -> isolation token, for positions below
        ``num_prompt_tokens`` (``first_token``: the token id at position 0)."""
        out: dict[int, int] = {}
        for item in self.mm_items:
            ident = _field(b"mm", item.identifier)
            for i in range(item.length):
                pos = item.offset + i
                if pos >= num_prompt_tokens:
                    break
                out[pos] = isolation_token(ident, _field(b"mm-index", i))
        head = self.first_token_fields()
        if head and num_prompt_tokens > 0 and first_token is not None:
            base = out.get(0, first_token)
            out[0] = isolation_token(b"".join(head), _field(b"token", int(base)))
        return out


class KeyedTokens(Sequence[int]):
    """A request's token ids as LMCache keys them: ``base`` (a live view
    that grows as tokens are generated) with isolation tokens at a few
    positions. Slices come back as lists."""

    __slots__ = ("_base", "_overrides", "_positions")

    def __init__(self, base: Sequence[int], overrides: dict[int, int]) -> None:
        self._base = base
        self._overrides = dict(overrides)
        self._positions = sorted(self._overrides)

    @property
    def base(self) -> Sequence[int]:
        return self._base

    def __len__(self) -> int:
        return len(self._base)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self._base))
            out = list(self._base[index])
            if step != 1:
                return [self._overrides.get(p, t) for p, t in zip(range(start, stop, step), out)]
            lo = bisect.bisect_left(self._positions, start)
            hi = bisect.bisect_left(self._positions, stop)
            for p in self._positions[lo:hi]:
                out[p - start] = self._overrides[p]
            return out
        n = len(self._base)
        pos = index + n if index < 0 else index
        token = self._base[index]
        return self._overrides.get(pos, token)

    def __iter__(self) -> Iterator[int]:
        for pos, token in enumerate(self._base):
            yield self._overrides.get(pos, token)


def key_tokens(token_ids: Sequence[int], num_prompt_tokens: int, keys: RequestKeys) -> Sequence[int]:
    """The token ids LMCache keys ``token_ids`` by: ``token_ids`` itself
    for a plain request (its keys stay what they were), else a
    :class:`KeyedTokens` view."""
    if keys.plain:
        return token_ids
    first = int(token_ids[0]) if len(token_ids) else None
    return KeyedTokens(token_ids, keys.overrides(num_prompt_tokens, first))


@dataclass(frozen=True)
class Refusal:
    """Why a request is neither looked up nor stored: something vLLM's
    prefix cache keys on that these keys cannot cover (fail closed)."""

    kind: str  # one word, a metric label and the once-per-kind log key
    detail: str = field(default="", compare=False)
