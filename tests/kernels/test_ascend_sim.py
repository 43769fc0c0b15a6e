# SPDX-License-Identifier: Apache-2.0
"""The AscendC kernels on the AscendC simulation, checked by the CPU op tests.

lmca_ascend_sim (test-only, see sim_module.py) runs each op through the op layer's Ascend path,
the NPU launchers' meta packing and the real AscendC kernel bodies
(csrc/ascend/kernels) on simulated AI cores with the hardware's rules
checked.  The tests below run the byte-exact checks of the CPU op tests
(test_ops_*.py, from token_row_checks.py, block_kv_checks.py and
multi_plane_checks.py) unchanged, with `native` bound to the simulation on
several machines (block dims 1, 4, 20, 40; UB sizes whose tiles are
smaller than a row or a page, so spans are moved in pieces with a tail).
test_ascend_sim_rules.py holds the planted violations.
"""

from __future__ import annotations

import pytest
import torch

import sim_module  # noqa: E402

sim = sim_module.require()

import block_kv_checks as bk  # noqa: E402
import multi_plane_checks as mp  # noqa: E402
import token_row_checks as tr  # noqa: E402
from kernel_helpers import DTYPES  # noqa: E402

KIB = 1024


class Machine:
    """Stands in for lmcache_ascend.ops: every op runs on one simulated
    machine and its counters are kept in `runs`."""

    def __init__(self, block_dim: int, ub_bytes: int, tile_bytes: int = -1,
                 task_ratio: int = 1, gather: bool = True):
        self.block_dim, self.ub_bytes, self.tile_bytes = block_dim, ub_bytes, tile_bytes
        self.task_ratio, self.gather = task_ratio, gather
        self.runs: list[dict] = []

    def __getattr__(self, name):
        op = getattr(sim, name)

        def call(*args, **kwargs):
            self.runs.append(op(*args, **kwargs, block_dim=self.block_dim,
                                ub_bytes=self.ub_bytes, tile_bytes=self.tile_bytes,
                                task_ratio=self.task_ratio, gather=self.gather))

        return call

    def __repr__(self) -> str:
        mix = "-mix" if self.task_ratio == 2 else ""
        spans = "" if self.gather else "-spans"
        return f"cores{self.block_dim}-ub{self.ub_bytes}{mix}{spans}"


# (block_dim, UB bytes, tile, task ratio, gather): the default 192 KiB UB
# (92 KiB tiles) on 1..40 cores, then UBs whose tiles are 448, 96 and 32
# bytes, so 584- and 132-byte rows, HND heads and pages are copied in several
# pieces; MIX launches (GetBlockIdx over twice the cores); and every span
# moved on its own (no gathering).
MACHINES = [(1, 192 * KIB), (4, 192 * KIB), (20, 192 * KIB), (40, 192 * KIB),
            (4, 1 * KIB), (20, 256), (40, 64), (1, 96),
            (20, 192 * KIB, -1, 2), (40, 256, -1, 2), (4, 192 * KIB, -1, 1, False)]
MACHINE_IDS = [repr(Machine(*m)) for m in MACHINES]


@pytest.fixture(params=MACHINES, ids=MACHINE_IDS)
def machine(request) -> Machine:
    return Machine(*request.param)


# ---- the CPU op tests, on the simulated NPU ---------------------------------

@pytest.mark.parametrize("padded", [False, True], ids=["tight", "padded"])
@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", tr.ALL_FORMATS)
def test_token_rows_vs_reference(machine, gen, fmt, d2h, padded):
    tr.check_multi_layer_vs_reference(machine, gen, fmt, d2h, padded)


@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", tr.NHD_FORMATS)
def test_token_rows_vs_lmcache_baseline(machine, gen, fmt, d2h):
    for dtype in DTYPES:
        tr.check_multi_layer_vs_lmcache_baseline(machine, gen, fmt, dtype, d2h)


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", tr.ALL_FORMATS)
def test_single_layer(machine, gen, fmt, d2h, token_major):
    tr.check_single_layer(machine, gen, fmt, d2h, token_major)


def test_strided_chunk_and_short_slot_mapping(machine, gen):
    tr.check_strided_chunk_and_short_slot_mapping(machine, gen)


@pytest.mark.parametrize("d2h", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("fmt", bk.ALL_FORMATS)
def test_block_kv(machine, gen, fmt, d2h):
    bk.check_block_kv_vs_lmcache_baseline(machine, gen, fmt, d2h)
    bk.check_block_kv_padded_vs_reference(machine, gen, fmt, d2h)


@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_multi_plane(machine, to_chunk):
    mp.check_dsv4_like_many_layers(machine, to_chunk)  # 584/132/6-byte rows, 61 layers
    mp.check_random_geometries(machine, to_chunk)


def test_multi_plane_shared_blob_and_round_trip(machine):
    mp.check_shared_blob_planes(machine)
    mp.check_round_trip_restores_selected_rows(machine)


@pytest.mark.parametrize("tight", [True, False], ids=["tight", "padded"])
@pytest.mark.parametrize("to_chunk", [True, False], ids=["store", "load"])
def test_block_pages(machine, to_chunk, tight):
    mp.check_block_pages(machine, to_chunk, tight)


def test_block_pages_vllm_cpu_layout(machine):
    mp.check_block_pages_vllm_cpu_layout(machine)


# ---- the op layer's checks run before any kernel ----------------------------

def test_bad_inputs_rejected_before_any_write(gen):
    m = Machine(4, 1 * KIB)
    bk.check_block_kv_rejects_bad_block_ids_before_writing(m, gen)
    assert m.runs == []  # no simulated launch started


def test_non_cpu_tensor_is_refused():
    chunk = torch.zeros(8, dtype=torch.uint8, device="meta")
    with pytest.raises(RuntimeError, match="runs on host memory"):
        sim.block_page_transfer(chunk, torch.tensor([1]), 8, 8, 1,
                                torch.tensor([0]), True)


# ---- what the machine did ----------------------------------------------------

def _dsv4_store(machine: Machine):
    mp.check_dsv4_like_many_layers(machine, True)
    (run,) = machine.runs
    return run


def test_rows_wider_than_a_tile_move_in_pieces():
    """584-byte rows on a 256-byte UB (96-byte tiles: a tile smaller than a
    row): every copy is at most one tile and there are more copies than
    rows."""
    run = _dsv4_store(Machine(20, 256))
    assert run["tile_bytes"] == 96 == sim.launch_tile_bytes(256)
    assert run["max_copy_bytes"] == 96
    assert run["copies_in"] == run["copies_out"] > 61 * (64 + 64 + 3)
    assert run["ub_peak_bytes"] == 192 and run["max_queue_occupancy"] == 1


def test_default_ub_moves_whole_runs_on_every_core():
    run = _dsv4_store(Machine(40, 192 * KIB))
    assert run["tile_bytes"] == 92 * KIB == sim.launch_tile_bytes(192 * KIB)
    assert run["ub_peak_bytes"] == 184 * KIB  # two tiles; 8 KiB left as headroom
    assert run["active_cores"] == 40 and run["cores_run"] == 40
    assert run["bytes_in"] == run["bytes_out"] > 0


def test_more_cores_than_rows():
    page = 6
    pool = torch.arange(4 * page, dtype=torch.uint8)
    chunk = torch.zeros(2 * page, dtype=torch.uint8)
    run = sim.block_page_transfer(chunk, torch.tensor([pool.data_ptr()]), page, page, 4,
                                  torch.tensor([3, 1]), True, block_dim=40)
    assert chunk.tolist() == pool[3 * page:4 * page].tolist() + pool[page:2 * page].tolist()
    assert run["active_cores"] == 2 and run["cores_run"] == 40


def test_unset_tiling_word_overflows_a_small_ub():
    """tile_bytes=0 is what a launcher that does not write the tiling word
    sends: the kernel's 64 KiB default tiles need 128 KiB of UB."""
    pool = torch.zeros(64, dtype=torch.uint8)
    chunk = torch.zeros(64, dtype=torch.uint8)
    args = (chunk, torch.tensor([pool.data_ptr()]), 64, 64, 1, torch.tensor([0]), True)
    assert sim.block_page_transfer(*args, ub_bytes=128 * KIB, tile_bytes=0)["tile_bytes"] == 64 * KIB
    with pytest.raises(RuntimeError, match=r"InitBuffer: Unified Buffer overflow: 2 x 65536"):
        sim.block_page_transfer(*args, ub_bytes=64 * KIB, tile_bytes=0)
