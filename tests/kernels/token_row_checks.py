# SPDX-License-Identifier: Apache-2.0
"""The byte-exact checks of multi_layer_kv_transfer / single_layer_kv_transfer,
for any object with lmcache_ascend.ops' signatures as ``native``: the CPU
ops (test_ops_token_rows.py), the AscendC simulation (test_ascend_sim*.py)
and a device (test_ascend_sim_npu.py) run the same checks.

NHD and MLA formats are checked against LMCache's own torch baseline
(lmcache.v1.platform.torch_ops); HND formats and padded blocks, which the
baseline lacks, against the independent reference in kv_reference.py.
"""

from __future__ import annotations

import torch
from lmcache.lmcache_native import EngineKVFormat, TransferDirection
from lmcache.v1.platform import torch_ops

import kv_reference as ref
from kernel_helpers import DTYPES, assert_bytes_equal, int_view, rand_tensor, random_slots

CPU = torch.device("cpu")
NHD_FORMATS = [ref.TWO_NB_BS_NH_HS, ref.NB_TWO_BS_NH_HS, ref.NB_BS_HS]
ALL_FORMATS = NHD_FORMATS + list(ref.HND)

def geometry(fmt: int, gen: torch.Generator):
    nl = int(torch.randint(1, 5, (1,), generator=gen))
    bs = int(torch.randint(1, 9, (1,), generator=gen))
    nb = int(torch.randint(4, 12, (1,), generator=gen))
    nh = 1 if fmt == ref.NB_BS_HS else int(torch.randint(1, 4, (1,), generator=gen))
    hs = int(torch.randint(1, 24, (1,), generator=gen))
    n = int(torch.randint(1, nb * bs - bs + 1, (1,), generator=gen))
    return nl, bs, nb, nh, hs, n


def make_case(fmt, dtype, gen, padded: bool):
    nl, bs, nb, nh, hs, n = geometry(fmt, gen)
    tight = ref.tight_block_elems(fmt, bs, nh, hs)
    stride = tight + int(torch.randint(1, 7, (1,), generator=gen)) if padded else 0
    pools = [
        rand_tensor((ref.pool_elems(fmt, nb, bs, nh, hs, stride),), dtype, gen) for _ in range(nl)
    ]
    kv = rand_tensor((ref.num_kv(fmt), nl, n, nh * hs), dtype, gen)
    slots = random_slots(n, nb, bs, gen)
    skip = int(torch.randint(0, 3, (1,), generator=gen))
    return dict(nl=nl, bs=bs, nb=nb, nh=nh, hs=hs, stride=stride, pools=pools, kv=kv,
                slots=slots, skip=skip)


def run_native(native, fmt, c, kv, pools, d2h):
    ptrs = torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64)
    native.multi_layer_kv_transfer(
        kv, ptrs, c["slots"], CPU, c["nb"] * c["bs"],
        TransferDirection.D2H if d2h else TransferDirection.H2D,
        EngineKVFormat(fmt), block_size=c["bs"], head_size=c["hs"],
        skip_prefix_n_tokens=c["skip"], block_stride_elems=c["stride"],
    )


def check_multi_layer_vs_lmcache_baseline(native, gen, fmt, dtype, d2h):
    gen.manual_seed(fmt * 100 + DTYPES.index(dtype) * 7 + d2h)
    c = make_case(fmt, dtype, gen, padded=False)
    pools, kv = [p.clone() for p in c["pools"]], c["kv"].clone()
    run_native(native, fmt, c, kv, pools, d2h)

    base_pools = [int_view(p.clone()) for p in c["pools"]]
    base_kv = int_view(c["kv"].clone())
    nb, bs, h = c["nb"], c["bs"], c["nh"] * c["hs"]
    shapes = {ref.TWO_NB_BS_NH_HS: (2, nb * bs, h), ref.NB_TWO_BS_NH_HS: (nb, 2, bs, h),
              ref.NB_BS_HS: (nb * bs, h)}
    torch_ops.multi_layer_kv_transfer(
        base_kv, [p.view(shapes[fmt]) for p in base_pools], c["slots"], CPU, nb * bs,
        TransferDirection.D2H if d2h else TransferDirection.H2D, EngineKVFormat(fmt),
        block_size=bs, head_size=c["hs"], skip_prefix_n_tokens=c["skip"],
    )
    assert_bytes_equal(kv, base_kv, "chunk")
    for i, (p, q) in enumerate(zip(pools, base_pools)):
        assert_bytes_equal(p, q, f"paged layer {i}")


def check_multi_layer_vs_reference(native, gen, fmt, d2h, padded):
    for trial, dtype in enumerate(DTYPES):
        gen.manual_seed(fmt * 1000 + trial * 10 + 2 * d2h + padded)
        c = make_case(fmt, dtype, gen, padded=padded)
        pools, kv = [p.clone() for p in c["pools"]], c["kv"].clone()
        run_native(native, fmt, c, kv, pools, d2h)

        ref_pools = [int_view(p.clone()) for p in c["pools"]]
        ref_kv = int_view(c["kv"].clone())
        views = [ref.layer_view(p, fmt, c["nb"], c["bs"], c["nh"], c["hs"], c["stride"])
                 for p in ref_pools]
        ref.transfer(lambda k, l: ref_kv[k, l], views, c["slots"], fmt, c["bs"], d2h, c["skip"])
        # Whole pools compared: padding and unselected slots must be untouched.
        assert_bytes_equal(kv, ref_kv, f"chunk ({dtype})")
        for i, (p, q) in enumerate(zip(pools, ref_pools)):
            assert_bytes_equal(p, q, f"paged layer {i} ({dtype})")


def check_strided_chunk_and_short_slot_mapping(native, gen):
    """key_value may be a strided view (LMCache's gpu_buffer[:, :, :n]);
    rows beyond len(slot_mapping) are not touched."""
    fmt, dtype = ref.NB_TWO_BS_NH_HS, torch.bfloat16
    c = make_case(fmt, dtype, gen, padded=False)
    n = c["kv"].shape[2]
    big = rand_tensor((2, c["nl"], n + 5, c["nh"] * c["hs"]), dtype, gen)
    before = big.clone()
    view = big[:, :, : n + 3]
    slots = c["slots"][: n - 1] if n > 1 else c["slots"]
    c["slots"], c["skip"] = slots, 0
    run_native(native, fmt, c, view, c["pools"], True)
    ref_kv = int_view(before.clone())
    views = [ref.layer_view(int_view(p), fmt, c["nb"], c["bs"], c["nh"], c["hs"], 0)
             for p in c["pools"]]
    ref.transfer(lambda k, l: ref_kv[k, l], views, slots, fmt, c["bs"], True)
    assert_bytes_equal(big, ref_kv, "strided chunk")


def check_single_layer(native, gen, fmt, d2h, token_major):
    for trial, dtype in enumerate([torch.bfloat16, torch.float32, torch.float8_e4m3fn]):
        gen.manual_seed(fmt * 77 + trial * 5 + d2h * 2 + token_major)
        _, bs, nb, nh, hs, n = geometry(fmt, gen)
        pool = rand_tensor((ref.pool_elems(fmt, nb, bs, nh, hs, 0),), dtype, gen)
        vllm = ref.layer_view(pool, fmt, nb, bs, nh, hs, 0)
        mla = fmt == ref.NB_BS_HS
        lmc_shape = (n, nh * hs) if mla else ((n, 2, nh * hs) if token_major else (2, n, nh * hs))
        lmc = rand_tensor(lmc_shape, dtype, gen)
        slots = random_slots(n, nb, bs, gen)
        lmc0, pool0 = lmc.clone(), pool.clone()
        direction = TransferDirection.D2H if d2h else TransferDirection.H2D
        native.single_layer_kv_transfer(lmc, vllm, slots, direction, EngineKVFormat(fmt),
                                        token_major=token_major)

        ref_pool, ref_lmc = int_view(pool0.clone()), int_view(lmc0.clone())
        ref_vllm = ref.layer_view(ref_pool, fmt, nb, bs, nh, hs, 0)
        if fmt in NHD_FORMATS:  # LMCache's baseline covers these
            torch_ops.single_layer_kv_transfer(ref_lmc, ref_vllm, slots, direction,
                                               EngineKVFormat(fmt), token_major=token_major)
        else:
            rows = (lambda k, l: ref_lmc[:, k]) if token_major else (lambda k, l: ref_lmc[k])
            ref.transfer(rows, [ref_vllm], slots, fmt, bs, d2h)
        assert_bytes_equal(lmc, ref_lmc, f"lmc ({dtype})")
        assert_bytes_equal(pool, ref_pool, f"paged ({dtype})")
