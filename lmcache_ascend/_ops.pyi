# SPDX-License-Identifier: Apache-2.0
"""Type stub of the compiled module lmcache_ascend._ops (re-exported as lmcache_ascend.ops) (see docs/kernels.md).

direction: lmcache.lmcache_native.TransferDirection or int (H2D=0: LMCache
-> paged, D2H=1: paged -> LMCache).  engine_kv_format:
lmcache.lmcache_native.EngineKVFormat or int (1, 2, 3, 6, 7 supported).
"""

from collections.abc import Sequence
from typing import Any, SupportsInt

import torch

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
) -> None: ...
def single_layer_kv_transfer(
    lmc_key_value_cache: torch.Tensor,
    vllm_key_value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    direction: SupportsInt,
    engine_kv_format: SupportsInt,
    token_major: bool = False,
) -> None: ...
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
) -> None: ...
def lmcache_memcpy_async(
    dest: int | torch.Tensor,
    src: int | torch.Tensor,
    nbytes: int,
    direction: SupportsInt,
    host_buffer_offset: int,
    host_buffer_alignments: int,
) -> None: ...
def batched_memcpy(src_ptrs: Sequence[int], dst_ptrs: Sequence[int], sizes: Sequence[int]) -> None: ...
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
) -> None: ...
def block_page_transfer(
    chunk: torch.Tensor,
    layer_ptrs: torch.Tensor,
    page_bytes: int,
    block_stride_bytes: int,
    num_blocks: int,
    block_ids: torch.Tensor,
    to_chunk: bool,
) -> None: ...
def built_backends() -> list[str]: ...
def cpu_copy_threads() -> int: ...
