# SPDX-License-Identifier: Apache-2.0
"""Planted violations: the AscendC simulation raises on each broken rule.

Each case is a small AscendC kernel (csrc/sim/violation_kernels.cpp)
that breaks one modeled hardware rule; 'control' is the same copy written
correctly and must pass.
"""

from __future__ import annotations

import pytest

import sim_module  # noqa: E402

sim = sim_module.require()

MIX = {"task_ratio": 2}  # MIX launch: GetBlockIdx() over [0, 2 * block_dim)
A310P = {"soc": "Ascend310P3"}

# name: (the error it must raise, machine it runs on)
PLANTED = {
    "misaligned_datacopy_length": (r"DataCopy \(GM->UB\): moves whole 32-byte blocks, but 6 x 1 bytes", {}),
    "misaligned_datacopy_ub_address": (r"DataCopy \(GM->UB\): UB address 8 is not 32-byte aligned", {}),
    "ub_overflow": (r"InitBuffer: Unified Buffer overflow: 2 x 131072 bytes .* 196608 UB bytes", {}),
    "dequeue_empty": (r"DeQue from an empty TQueBind<VECIN, VECOUT>", {}),
    "enqueue_beyond_depth": (r"EnQue on TQueBind<VECIN, VECOUT> \(depth 1\): 1 tensor\(s\) already", {}),
    "alloc_beyond_count": (r"AllocTensor on .*: all 2 buffers from InitBuffer are allocated", {}),
    "free_not_allocated": (r"FreeTensor of a tensor that is not allocated", {}),
    "use_after_free": (r"DataCopyPad \(GM->UB\): LocalTensor used after FreeTensor", {}),
    "unbound_local_tensor": (r"LocalTensor was not obtained from AllocTensor, DeQue or TBuf::Get", {}),
    "tensor_leaked": (r"kernel ended with a tensor of .* still allocated", {}),
    "copy_out_without_handover": (r"MTE3 \(UB->GM\) reads a UB buffer whose last write by MTE2", {}),
    "vecin_queue_for_copy_out": (r"MTE3 \(UB->GM\) reads a UB buffer whose last write by MTE2", {}),
    "store_unwritten_ub": (r"DataCopy \(UB->GM\): stores 26 UB bytes .* never wrote", {}),
    "gm_out_of_bounds": (r"GM bytes \[scratch\+4096 \(past its 4096 bytes\), \+6\) lie outside", {}),
    "blocklen_too_long": (r"blockLen \(bytes\) = 2097152 is outside \[0, 2097151\]", {}),
    "blockcount_too_large": (r"blockCount = 4096 is outside \[0, 4095\]", {}),
    "cross_core_write_race": (r"GM data race: core 1 writes 6 bytes at scratch\+64 that core 0 also writes", {}),
    "free_events_exhausted": (r"FreeTensor: all 8 event ids of HardEvent::MTE3_MTE2 are in use", {}),
    "inplace_queue_events_exhausted": (r"InitBuffer: all 8 event ids of HardEvent::MTE2_MTE3 are in use", {}),
    "missing_core_guard": (r"core [2-3] of 4: GlobalTensor::GetValue\(64\): beyond its 64 elements", MIX),
    "control": (r"DataCopyPad \(GM->UB\): DataCopyPad between GM and UB does not exist on this SoC "
                r"\(__NPU_ARCH__ 2002", A310P),
}

# Legal kernels the simulation must accept (each next to a planted case of
# the same rule).
LEGAL = {
    "zero_length_copies": {},  # vs blocklen_too_long / blockcount_too_large
    "ten_vecin_buffers_two_event_kinds": {},  # vs free_events_exhausted
    "inplace_queue": {},  # vs inplace_queue_events_exhausted
    "tbuf_default_position": {},
    "core_guard": MIX,  # vs missing_core_guard
    "missing_core_guard": {},  # an AIV-only launch never runs the extra cores
}


def test_every_planted_kernel_is_checked():
    assert set(sim.planted_violation_names()) == set(PLANTED) | set(LEGAL) | {"control"}


@pytest.mark.parametrize("block_dim", [1, 2, 8])
def test_control_passes(block_dim):
    run = sim.run_planted_violation("control", block_dim=block_dim)
    assert run["copies_in"] == run["copies_out"] == block_dim
    assert run["ub_peak_bytes"] == 512 and run["max_queue_occupancy"] == 1


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_violation_is_caught(name):
    pattern, machine = PLANTED[name]
    with pytest.raises(RuntimeError, match=pattern) as err:
        sim.run_planted_violation(name, block_dim=2, **machine)
    assert str(err.value).startswith("AscendC simulation: ")


@pytest.mark.parametrize("name", sorted(LEGAL))
def test_legal_kernel_passes(name):
    run = sim.run_planted_violation(name, block_dim=2, **LEGAL[name])
    assert run["cores_run"] == 2 * LEGAL[name].get("task_ratio", 1)


def test_zero_length_copies_move_nothing():
    run = sim.run_planted_violation("zero_length_copies", block_dim=1)
    assert run["copies_in"] == run["copies_out"] == run["bytes_in"] == run["bytes_out"] == 0


def test_inplace_queue_copies_like_control():
    run = sim.run_planted_violation("inplace_queue", block_dim=4)
    assert run["copies_in"] == run["copies_out"] == 4 and run["bytes_out"] == 4 * 6


def test_ub_capacity_is_the_machines():
    # 2 x 128 KiB overflows the default 192 KiB UB but fits a 256 KiB one.
    sim.run_planted_violation("ub_overflow", ub_bytes=256 * 1024)
    sim.run_planted_violation("control", ub_bytes=512)  # 2 x 256 bytes: exactly full
    with pytest.raises(RuntimeError, match="Unified Buffer overflow: 2 x 256 bytes"):
        sim.run_planted_violation("control", ub_bytes=480)


def test_machine_arguments_are_validated():
    with pytest.raises(ValueError, match="block_dim = 0"):
        sim.run_planted_violation("control", block_dim=0)
    with pytest.raises(ValueError, match="ub_bytes = 100"):
        sim.run_planted_violation("control", ub_bytes=100)
    with pytest.raises(ValueError, match="unknown planted violation"):
        sim.run_planted_violation("no_such_rule")
