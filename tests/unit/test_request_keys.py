"""Chunk keys cover what vLLM's prefix cache keys on (cache_salt, LoRA,
multimodal items, prompt embeddings), checked against vLLM's own block
hasher (``get_request_block_hasher``, the function its prefix cache keys
blocks with) on real vLLM ``Request`` objects: for every pair of requests
and every chunk boundary, the connector's key tokens up to the boundary are
equal exactly when vLLM's block hashes there are equal."""

from __future__ import annotations

import inspect
import itertools
import logging
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="reads vLLM's Request")

import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from lmcache_ascend.integration.vllm.scheduler import SchedulerHalf
from lmcache_ascend.integration.vllm.vllm_keys import MAX_SALT_CHARS, request_keys, request_view
from lmcache_ascend.planning.groups import GroupKind, SchedulerGroup
from lmcache_ascend.planning.isolation import (
    ISOLATION_CEILING,
    KeyedTokens,
    LoraIdentity,
    MultimodalItem,
    Refusal,
    RequestKeys,
    is_isolation_token,
    key_tokens,
)
from lmcache_ascend.planning.state_align import MARK_MAGIC

BS = 16
PLACEHOLDER = 7  # one token id for every image, as in real VLM prompts


def _sha256():
    try:
        from vllm.utils.hashing import sha256
    except ImportError:  # older layouts
        from vllm.utils import sha256  # type: ignore[no-redef]
    return sha256


def _lora(tmp: Path, name: str, content: bytes, int_id: int) -> LoRARequest:
    d = tmp / f"adapter-{name}-{int_id}"
    d.mkdir(exist_ok=True)
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(content)
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=str(d))


def _feature(ident: str, offset: int, length: int) -> MultiModalFeatureSpec:
    params = inspect.signature(MultiModalFeatureSpec).parameters
    kwargs = dict(data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset, length))
    if "mm_hash" in params:
        kwargs["mm_hash"] = ident
    return MultiModalFeatureSpec(**{k: v for k, v in kwargs.items() if k in params})


def _request(rid: str, tokens: list[int], salt=None, lora=None, mm=(), hasher=None) -> Request:
    return Request(
        rid, list(tokens), SamplingParams(max_tokens=1), None,
        mm_features=list(mm) or None, lora_request=lora, cache_salt=salt, block_hasher=hasher,
    )


def _cases(tmp: Path):
    """(name, tokens, salt, lora, mm items): same tokens throughout except
    where a case says so; images sit at placeholders 20..43."""
    base = [1000 + i for i in range(96)]
    with_ph = base[:20] + [PLACEHOLDER] * 24 + base[44:]
    lora_a = _lora(tmp, "a", b"weights-a" * 100, 1)
    lora_a2 = _lora(tmp, "a", b"weights-a2" * 100, 2)  # same name, other weights
    lora_b = _lora(tmp, "b", b"weights-b" * 100, 3)
    img1, img2 = _feature("img-1", 20, 24), _feature("img-2", 20, 24)
    img1_late = _feature("img-1", 36, 8)
    return [
        ("plain", base, None, None, ()),
        ("plain-other-tail", base[:60] + [5] * 36, None, None, ()),
        ("salt-x", base, "x", None, ()),
        ("salt-a", base, "a", None, ()),  # the text of adapter "a"'s name
        ("salt-x-again", base, "x", None, ()),
        ("salt-y", base, "y", None, ()),
        ("salt-at", base, "x@y", None, ()),
        ("empty-salt", base, "", None, ()),
        ("lora-a", base, None, lora_a, ()),
        ("lora-a-other-weights", base, None, lora_a2, ()),
        ("lora-b", base, None, lora_b, ()),
        ("lora-a-salt-x", base, "x", lora_a, ()),
        ("image-1", with_ph, None, None, (img1,)),
        ("image-1-again", with_ph, None, None, (img1,)),
        ("image-2", with_ph, None, None, (img2,)),
        ("image-1-late", with_ph, None, None, (img1_late,)),
        ("no-image-placeholders", with_ph, None, None, ()),
        ("image-1-salt-x", with_ph, "x", None, (img1,)),
    ]


# Requests vLLM 0.23-0.30 confuse (adapter name alone, salt and adapter name
# untagged): any two of these share vLLM's block hashes there.
WEAKER_IN_VLLM = {"lora-a", "lora-a-other-weights", "salt-a"}


def test_key_tokens_equal_exactly_where_vllm_block_hashes_are_equal(tmp_path):
    hash_fn = _sha256()
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(BS, hash_fn)
    keyed, hashes = {}, {}
    for name, tokens, salt, lora, mm in _cases(tmp_path):
        req = _request(name, tokens, salt, lora, mm, hasher)
        view = request_view(req)
        assert view.refusal is None, (name, view.refusal)
        keyed[name] = view.token_ids
        hashes[name] = list(req.block_hashes)
        assert len(hashes[name]) == len(tokens) // BS
    checked = stricter = 0
    for a, b in itertools.combinations(keyed, 2):
        for k in range(1, len(hashes[a]) + 1):
            ours = list(keyed[a][: k * BS]) == list(keyed[b][: k * BS])
            theirs = hashes[a][k - 1] == hashes[b][k - 1]
            checked += 1
            if ours == theirs:
                continue
            # Never serve what vLLM would not. Stricter than vLLM only where
            # vLLM's keys are weaker by its own admission: vLLM 0.23 keys an
            # adapter by name alone (two adapters of one name share blocks)
            # and leaves salts and adapter names untagged (salt "a" == adapter
            # "a", vLLM issue 44701); 0.32 keys by name and path, and the
            # keys by name and weights.
            assert theirs and not ours, f"{a} vs {b} at {k * BS} tokens: keys equal, vLLM's hashes differ"
            assert {a, b} <= WEAKER_IN_VLLM, (a, b)
            stricter += 1
    assert checked > 500
    # vLLM 0.32 agrees everywhere; older ones differ only among those three.
    assert stricter <= 3 * (96 // BS)
    # The cases that must differ and must not, spelled out.
    assert list(keyed["plain"]) == list(_cases(tmp_path)[0][1])  # unchanged keys for plain text
    assert keyed["plain"][:BS] == keyed["image-1"][:BS]  # prefix before the image still shared
    assert keyed["image-1"][:32] != keyed["image-2"][:32]


def test_plain_request_keeps_its_token_ids_object():
    tokens = [3, 4, 5]
    assert key_tokens(tokens, 3, RequestKeys()) is tokens
    assert key_tokens(tokens, 3, RequestKeys(cache_salt="")) is tokens


def test_isolation_tokens_are_disjoint_from_real_tokens_and_state_marks():
    keys = RequestKeys(cache_salt="s", mm_items=(MultimodalItem("i", 1, 5),))
    over = keys.overrides(10, 42)
    assert set(over) == {0, 1, 2, 3, 4, 5}
    assert all(v <= ISOLATION_CEILING and is_isolation_token(v) for v in over.values())
    assert MARK_MAGIC > ISOLATION_CEILING and not is_isolation_token(MARK_MAGIC)


def test_salt_and_lora_name_never_collide():
    same = RequestKeys(cache_salt="a").overrides(4, 9)[0]
    other = RequestKeys(lora=LoraIdentity("a", "f" * 32)).overrides(4, 9)[0]
    joined = RequestKeys(cache_salt="ab").overrides(4, 9)[0]
    split = RequestKeys(cache_salt="a", lora=LoraIdentity("b", "f" * 32)).overrides(4, 9)[0]
    assert len({same, other, joined, split}) == 4


def test_keyed_tokens_is_a_live_view_with_slices_and_indexing():
    base = list(range(100, 110))
    view = KeyedTokens(base, {0: -(1 << 40), 5: -(1 << 41)})
    assert view[0] == -(1 << 40) and view[1] == 101 and view[5] == -(1 << 41) and view[-1] == 109
    assert view[3:7] == [103, 104, -(1 << 41), 106]
    assert view[::5] == [-(1 << 40), -(1 << 41)]
    assert list(view)[:2] == [-(1 << 40), 101]
    base.extend([7, 8])  # generated tokens appear, unkeyed
    assert len(view) == 12 and view[-2:] == [7, 8]


@pytest.mark.parametrize("salt", ["@", "a@b@c", "x" * MAX_SALT_CHARS, "\x00\n", "日本"])
def test_odd_salts_key_without_breaking_anything(salt):
    req = _request("r", list(range(1, 40)), salt=salt)
    view = request_view(req)
    assert view.refusal is None
    assert is_isolation_token(view.token_ids[0]) and view.token_ids[1:] == list(range(2, 40))


def test_oversized_salt_is_refused_naming_the_limit():
    keys, refusal = request_keys(_request("r", [1, 2, 3], salt="x" * (MAX_SALT_CHARS + 1)))
    assert refusal is not None and refusal.kind == "cache_salt" and str(MAX_SALT_CHARS) in refusal.detail


def test_prompt_embeds_and_unreadable_adapters_are_refused(tmp_path):
    req = _request("r", [1, 2, 3])
    req.prompt_embeds = torch.zeros(3, 4)
    assert request_view(req).refusal.kind == "prompt_embeds"
    gone = LoRARequest(lora_name="gone", lora_int_id=9, lora_path=str(tmp_path / "missing"))
    view = request_view(_request("r2", [1, 2, 3], lora=gone))
    assert view.refusal.kind == "lora" and "gone" in view.refusal.detail


def test_adapter_keys_follow_weights_not_paths(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    a1 = _lora(tmp_path / "x", "a", b"same", 1)
    a2 = _lora(tmp_path / "y", "a", b"same", 1)
    k1, _ = request_keys(_request("r", [1], lora=a1))
    k2, _ = request_keys(_request("r", [1], lora=a2))
    assert k1.lora == k2.lora  # another instance, same adapter files: shared
    (Path(a2.lora_path) / "adapter_model.safetensors").write_bytes(b"changed")
    k3, _ = request_keys(_request("r", [1], lora=a2))
    assert k3.lora != k1.lora  # rewritten in place: new size/mtime, new fingerprint


def _half(lookups: list) -> SchedulerHalf:
    groups = (SchedulerGroup(index=0, kind=GroupKind.FULL, spec_name="FullAttentionSpec", block_size=BS),)

    def lookup(tokens, req_id):
        lookups.append((req_id, list(tokens)))
        return len(tokens)

    return SchedulerHalf(groups, BS, lookup)


def test_refused_requests_are_neither_looked_up_nor_stored_and_logged_once(caplog):
    lookups: list = []
    half = _half(lookups)
    caplog.set_level(logging.WARNING)
    for i in range(3):
        req = _request(f"e{i}", list(range(1, 50)))
        req.prompt_embeds = torch.zeros(49, 4)
        assert half.get_num_new_matched_tokens(request_view(req), 0) == (0, False)
        half.track(request_view(req))
    assert lookups == [] and half.stats.isolation_refusals == 6
    lines = [r for r in caplog.records if "neither looked up nor stored" in r.getMessage()]
    assert len(lines) == 1 and "prompt_embeds" in lines[0].getMessage()
    # Salted requests are looked up with their key tokens.
    half.get_num_new_matched_tokens(request_view(_request("s", list(range(1, 50)), salt="t")), 0)
    assert len(lookups) == 1 and is_isolation_token(lookups[0][1][0])


def test_refuse_all_applies_to_every_request():
    view = request_view(_request("r", [1, 2, 3]), Refusal("model_identity", "weights unreadable"))
    assert view.refusal.kind == "model_identity"
