# SPDX-License-Identifier: Apache-2.0
"""Type stub of lmca_ascend_sim, the test-only module (built into
build/ascend-sim/, never into the lmcache_ascend package): the AscendC
kernels on a host simulation of the AscendC API (see docs/kernels.md,
"AscendC simulation").

Ops mirror lmcache_ascend.ops (same arguments, CPU tensors) plus the
keyword-only machine: block_dim (simulated cores), ub_bytes (UB per core),
tile_bytes (-1: derived from ub_bytes; 0: the kernel's default).  They
return the simulation's counters.  A broken hardware rule raises
RuntimeError.
"""

from collections.abc import Sequence
from typing import Any, SupportsInt

import torch

DEFAULT_BLOCK_DIM: int
DEFAULT_UB_BYTES: int
DEFAULT_TILE_BYTES: int

def multi_layer_kv_transfer(
    key_value: torch.Tensor,
    key_value_ptrs: torch.Tensor | Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    paged_memory_device: torch.device | str,
    page_buffer_size: int,
    direction: SupportsInt,
    engine_kv_format: SupportsInt,
    block_size: int = 0,
    head_size: int = 0,
    skip_prefix_n_tokens: int = 0,
    block_stride_elems: int = 0,
    *,
    block_dim: int = ...,
    ub_bytes: int = ...,
    tile_bytes: int = -1,
) -> dict[str, int]: ...
def single_layer_kv_transfer(
    lmc_key_value_cache: torch.Tensor,
    vllm_key_value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    direction: SupportsInt,
    engine_kv_format: SupportsInt,
    token_major: bool = False,
    *,
    block_dim: int = ...,
    ub_bytes: int = ...,
    tile_bytes: int = -1,
) -> dict[str, int]: ...
def multi_layer_block_kv_transfer(
    paged_buffer_ptrs_tensor: torch.Tensor | Sequence[torch.Tensor],
    lmcache_objects_ptrs: Sequence[int] | Sequence[torch.Tensor],
    block_ids: torch.Tensor | Sequence[int],
    device: torch.device | str,
    direction: SupportsInt,
    shape_desc: Any,
    lmcache_chunk_size: int,
    engine_kv_format: SupportsInt,
    skip_prefix_n_blocks: int,
    *,
    block_dim: int = ...,
    ub_bytes: int = ...,
    tile_bytes: int = -1,
) -> dict[str, int]: ...
def multi_plane_kv_transfer(
    chunk: torch.Tensor,
    plane_ptrs: torch.Tensor,
    plane_block_sizes: torch.Tensor,
    plane_block_stride_bytes: torch.Tensor,
    plane_row_bytes: torch.Tensor,
    plane_num_blocks: torch.Tensor,
    slot_mapping: torch.Tensor,
    plane_slot_offsets: torch.Tensor,
    to_chunk: bool,
    num_layers: int,
    *,
    block_dim: int = ...,
    ub_bytes: int = ...,
    tile_bytes: int = -1,
) -> dict[str, int]: ...
def block_page_transfer(
    chunk: torch.Tensor,
    layer_ptrs: torch.Tensor,
    page_bytes: int,
    block_stride_bytes: int,
    num_blocks: int,
    block_ids: torch.Tensor,
    to_chunk: bool,
    *,
    block_dim: int = ...,
    ub_bytes: int = ...,
    tile_bytes: int = -1,
) -> dict[str, int]: ...
def run_planted_violation(
    name: str, *, block_dim: int = ..., ub_bytes: int = ..., tile_bytes: int = -1
) -> dict[str, int]: ...
def planted_violation_names() -> list[str]: ...
def ub_tile_bytes(ub_bytes: int) -> int: ...
