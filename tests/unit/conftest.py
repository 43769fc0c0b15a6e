"""Unit tests run without vLLM and without the native extension; where the
extension is importable, the transfer tests also run through it."""

import importlib

import pytest


def _ops_modules():
    from lmcache_ascend.transfer import reference_ops

    mods = [pytest.param(reference_ops, id="reference")]
    try:
        mods.append(pytest.param(importlib.import_module("lmcache_ascend.ops"), id="native"))
    except ImportError:
        pass
    return mods


@pytest.fixture(params=_ops_modules())
def ops(request):
    return request.param


@pytest.fixture(scope="module")
def allocator():
    """LMCache's own allocator for chunk buffers (fixtures/lmcache_objs.py)."""
    import torch
    from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator

    return TensorMemoryAllocator(torch.empty(96 << 20, dtype=torch.uint8))
