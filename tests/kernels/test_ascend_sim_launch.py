# SPDX-License-Identifier: Apache-2.0
"""How the AscendC kernels are launched and how they move data, on the
simulation: kernel type and MIX launches, the host-side tiling checks and SoC
refusal, and the DMA bursts of gathered versus span-by-span copies (counted
against bursts derived from the slot runs, bytes against numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sim_module
import multi_plane_checks as mp
import token_row_checks as tr

sim = sim_module.require()

KIB = 1024
KERNEL_TYPE_AIV_ONLY = 0  # KernelMetaType (AscendC "设置Kernel类型" docs)


def _pages_call(chunk, pool, ids, page, **machine):
    return sim.block_page_transfer(chunk, torch.tensor([pool.data_ptr()]), page, page,
                                   pool.numel() // page, torch.tensor(ids), True, **machine)


def test_every_kernel_declares_aiv_only(gen):
    runs = []

    class Recorder:
        def __getattr__(self, name):
            op = getattr(sim, name)
            return lambda *a, **k: runs.append(op(*a, **k))

    mp.check_dsv4_like_many_layers(Recorder(), True)  # multi-plane kernel
    mp.check_block_pages(Recorder(), True, True)  # block-page kernel
    tr.check_single_layer(Recorder(), gen, tr.ALL_FORMATS[0], True, False)  # token rows
    launched = [r for r in runs if r["launches"]]  # calls with no rows launch nothing
    assert len(launched) >= 3
    assert all(r["task_type"] == KERNEL_TYPE_AIV_ONLY for r in launched)
    assert all(r["task_type"] == -1 for r in runs if not r["launches"])


def test_mix_launch_runs_extra_cores_that_do_nothing():
    """task_ratio=2: 2N vector cores run with GetBlockIdx over [0, 2N); the
    guarded kernels let only the first N work and the bytes are exact."""
    page = 64
    pool = torch.randint(0, 256, (16 * page,), dtype=torch.uint8)
    chunk = torch.zeros(8 * page, dtype=torch.uint8)
    ids = [9, 2, 3, 15, 0, 7, 8, 1]
    run = _pages_call(chunk, pool, ids, page, block_dim=4, task_ratio=2)
    expected = pool.view(16, page)[ids].reshape(-1)
    assert torch.equal(chunk, expected)
    assert run["cores_run"] == 8 and run["active_cores"] == 4


def test_tile_is_checked_on_the_host():
    pool = torch.zeros(64, dtype=torch.uint8)
    chunk = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"tile_bytes = 100: .*positive multiple of 32"):
        _pages_call(chunk, pool, [0], 64, tile_bytes=100)
    with pytest.raises(ValueError, match=r"tile_bytes = 544: .*2 tiles exceed the 1024-byte UB"):
        _pages_call(chunk, pool, [0], 64, ub_bytes=1 * KIB, tile_bytes=544)
    assert chunk.sum() == 0  # refused before any byte moved


def test_launch_tile_leaves_headroom():
    assert sim.launch_tile_bytes(192 * KIB) == 92 * KIB  # (192 KiB - 8 KiB) / 2
    assert sim.launch_tile_bytes(1 * KIB) == 448  # (1024 - 128) / 2
    assert sim.ub_tile_bytes(192 * KIB) == 96 * KIB


def test_310p_is_refused_before_launch():
    pool = torch.zeros(64, dtype=torch.uint8)
    chunk = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"Ascend310P3 .* has no DataCopyPad between GM and UB"):
        _pages_call(chunk, pool, [0], 64, soc="Ascend310P3")
    with pytest.raises(ValueError, match=r"soc = 'Ascend999' is not modeled"):
        _pages_call(chunk, pool, [0], 64, soc="Ascend999")


# ---- DMA bursts ---------------------------------------------------------------

SLOTS = [0, 1, 9, 5, 6, 7, 14, 3]  # block size 4: runs [0 1] [9] [5 6 7] [14] [3]
RUNS = 5


def _one_plane(row_bytes: int, to_chunk: bool, gather: bool):
    bs, nb = 4, 4
    rng = np.random.default_rng(row_bytes)
    pool = torch.from_numpy(rng.integers(0, 256, nb * bs * row_bytes, dtype=np.uint8))
    chunk = torch.from_numpy(rng.integers(0, 256, len(SLOTS) * row_bytes, dtype=np.uint8))
    before_pool, before_chunk = pool.clone(), chunk.clone()
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    run = sim.multi_plane_kv_transfer(
        chunk, t([pool.data_ptr()]), t([bs]), t([bs * row_bytes]), t([row_bytes]), t([nb]),
        t(SLOTS), t([0, len(SLOTS)]), to_chunk, 1, block_dim=1, gather=gather)
    rows = before_pool.view(nb * bs, row_bytes)
    if to_chunk:
        assert torch.equal(chunk.view(-1, row_bytes), rows[SLOTS])
    else:
        expected = rows.clone()
        expected[SLOTS] = before_chunk.view(-1, row_bytes)
        assert torch.equal(pool.view(nb * bs, row_bytes), expected)
    return run


@pytest.mark.parametrize("row_bytes", [64, 6], ids=["aligned", "unaligned"])
def test_gathered_store_is_one_burst_per_run_and_one_per_tile(row_bytes):
    run = _one_plane(row_bytes, to_chunk=True, gather=True)
    assert (run["bursts_in"], run["bursts_out"]) == (RUNS, 1)
    assert (run["copies_in"], run["copies_out"]) == (RUNS, 1)
    spans = _one_plane(row_bytes, to_chunk=True, gather=False)
    assert (spans["bursts_in"], spans["bursts_out"]) == (RUNS, RUNS)


@pytest.mark.parametrize("row_bytes", [64, 6], ids=["aligned", "unaligned"])
def test_gathered_load_is_one_burst_per_tile_and_one_per_run(row_bytes):
    run = _one_plane(row_bytes, to_chunk=False, gather=True)
    assert (run["bursts_in"], run["bursts_out"]) == (1, RUNS)
    spans = _one_plane(row_bytes, to_chunk=False, gather=False)
    assert (spans["bursts_in"], spans["bursts_out"]) == (RUNS, RUNS)
