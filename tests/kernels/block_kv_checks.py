# SPDX-License-Identifier: Apache-2.0
"""The byte-exact checks of multi_layer_block_kv_transfer, for any object
with lmcache_ascend.ops' signatures as ``native``: the CPU ops
(test_ops_block_kv.py), the AscendC simulation (test_ascend_sim*.py) and a
device (test_ascend_sim_npu.py) run the same checks.

Block transfers are checked against LMCache's torch baseline (which covers
NHD, MLA and HND here) and, for padded blocks, against kv_reference.
"""

from __future__ import annotations

import pytest
import torch
from lmcache.lmcache_native import EngineKVFormat, PageBufferShapeDesc, TransferDirection
from lmcache.v1.platform import torch_ops

import kv_reference as ref
from kernel_helpers import DTYPES, assert_bytes_equal, int_view, rand_tensor

ALL_FORMATS = [ref.TWO_NB_BS_NH_HS, ref.NB_TWO_BS_NH_HS, ref.NB_BS_HS, *ref.HND]

def shape_desc(fmt, nl, nb, bs, nh, hs, es, stride, dtype=None):
    d = PageBufferShapeDesc()
    d.kv_size, d.nl, d.nb, d.bs, d.nh, d.hs = ref.num_kv(fmt), nl, nb, bs, nh, hs
    d.element_size, d.block_stride_elems = es, stride
    if dtype is not None:
        d.dtype = dtype
    return d


def make_case(fmt, dtype, gen, padded):
    nl = int(torch.randint(1, 4, (1,), generator=gen))
    bs = int(torch.randint(1, 6, (1,), generator=gen))
    nb = int(torch.randint(6, 14, (1,), generator=gen))
    nh = 1 if fmt == ref.NB_BS_HS else int(torch.randint(1, 4, (1,), generator=gen))
    hs = int(torch.randint(1, 20, (1,), generator=gen))
    bpo = int(torch.randint(1, 4, (1,), generator=gen))
    n_ids = int(torch.randint(1, min(nb, 3 * bpo) + 1, (1,), generator=gen))
    n_obj = -(-n_ids // bpo)
    tight = ref.tight_block_elems(fmt, bs, nh, hs)
    stride = tight + int(torch.randint(1, 5, (1,), generator=gen)) if padded else 0
    pools = [rand_tensor((ref.pool_elems(fmt, nb, bs, nh, hs, stride),), dtype, gen)
             for _ in range(nl)]
    obj_shape = (nl, bpo * bs, hs) if fmt == ref.NB_BS_HS else (2, nl, bpo * bs, nh * hs)
    objs = [rand_tensor(obj_shape, dtype, gen) for _ in range(n_obj)]
    ids = torch.randperm(nb, generator=gen)[:n_ids].to(torch.int64)
    skip = int(torch.randint(0, 2, (1,), generator=gen)) if n_ids > 1 else 0
    return dict(nl=nl, bs=bs, nb=nb, nh=nh, hs=hs, bpo=bpo, stride=stride, pools=pools,
                objs=objs, ids=ids, skip=skip)


def run_native(native, fmt, c, pools, objs, d2h, pointer_mode):
    es = pools[0].element_size()
    native.multi_layer_block_kv_transfer(
        torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64),
        [o.data_ptr() for o in objs] if pointer_mode else objs,
        c["ids"], torch.device("cpu"),
        TransferDirection.D2H if d2h else TransferDirection.H2D,
        shape_desc(fmt, c["nl"], c["nb"], c["bs"], c["nh"], c["hs"], es, c["stride"]),
        c["bpo"] * c["bs"], EngineKVFormat(fmt), c["skip"],
    )


def check_block_kv_vs_lmcache_baseline(native, gen, fmt, d2h):
    for trial, dtype in enumerate(DTYPES):
        gen.manual_seed(fmt * 31 + trial * 3 + d2h)
        c = make_case(fmt, dtype, gen, padded=False)
        pools, objs = [p.clone() for p in c["pools"]], [o.clone() for o in c["objs"]]
        run_native(native, fmt, c, pools, objs, d2h, pointer_mode=trial % 2 == 0)

        b_pools = [int_view(p.clone()) for p in c["pools"]]
        b_objs = [int_view(o.clone()) for o in c["objs"]]
        views = [ref.layer_view(p, fmt, c["nb"], c["bs"], c["nh"], c["hs"], 0) for p in b_pools]
        es = dtype.itemsize
        torch_ops.multi_layer_block_kv_transfer(
            views, b_objs, c["ids"], torch.device("cpu"),
            TransferDirection.D2H if d2h else TransferDirection.H2D,
            shape_desc(fmt, c["nl"], c["nb"], c["bs"], c["nh"], c["hs"], es, 0,
                        b_pools[0].dtype),
            c["bpo"] * c["bs"], EngineKVFormat(fmt), c["skip"],
        )
        for i, (o, q) in enumerate(zip(objs, b_objs)):
            assert_bytes_equal(o, q, f"object {i} ({dtype})")
        for i, (p, q) in enumerate(zip(pools, b_pools)):
            assert_bytes_equal(p, q, f"paged layer {i} ({dtype})")


def check_block_kv_padded_vs_reference(native, gen, fmt, d2h):
    gen.manual_seed(fmt * 13 + d2h)
    c = make_case(fmt, torch.bfloat16, gen, padded=True)
    pools, objs = [p.clone() for p in c["pools"]], [o.clone() for o in c["objs"]]
    run_native(native, fmt, c, pools, objs, d2h, pointer_mode=True)

    r_pools = [int_view(p.clone()) for p in c["pools"]]
    r_objs = [int_view(o.clone()) for o in c["objs"]]
    views = [ref.layer_view(p, fmt, c["nb"], c["bs"], c["nh"], c["hs"], c["stride"])
             for p in r_pools]
    bs, bpo = c["bs"], c["bpo"]
    for o, obj in enumerate(r_objs):
        slots = torch.full((bpo * bs,), -1, dtype=torch.int64)
        for j in range(o * bpo, min((o + 1) * bpo, c["ids"].numel())):
            if j >= c["skip"]:
                slots[(j - o * bpo) * bs:(j - o * bpo + 1) * bs] = c["ids"][j] * bs + torch.arange(bs)
        rows = (lambda k, l, obj=obj: obj[l]) if fmt == ref.NB_BS_HS else (
            lambda k, l, obj=obj: obj[k, l])
        ref.transfer(rows, views, slots, fmt, bs, d2h)
    for i, (o, q) in enumerate(zip(objs, r_objs)):
        assert_bytes_equal(o, q, f"object {i}")
    for i, (p, q) in enumerate(zip(pools, r_pools)):
        assert_bytes_equal(p, q, f"paged layer {i}")


def check_block_kv_rejects_bad_block_ids_before_writing(native, gen):
    fmt = ref.TWO_NB_BS_NH_HS
    c = make_case(fmt, torch.float16, gen, padded=False)
    c["ids"] = c["ids"].clone()
    c["ids"][-1] = c["nb"]  # one past the end
    c["skip"] = 0
    pools = [p.clone() for p in c["pools"]]
    with pytest.raises(ValueError, match=r"block_ids\[\d+\] = \d+ is out of range"):
        run_native(native, fmt, c, pools, c["objs"], False, pointer_mode=True)
    for p, q in zip(pools, c["pools"]):
        assert_bytes_equal(p, q, "paged untouched")
