"""Format detection: every entry kind, metadata-only permutes, clear errors."""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.planning.groups import Granularity
from lmcache_ascend.planning.kv_format import (
    LayerFormat,
    LayoutError,
    LayoutHints,
    detect_layer,
    physical_view,
)

# Imports neither vLLM nor LMCache: a stack sharing the primary's torch skips it.
pytestmark = pytest.mark.pure

ROW, PAGE = Granularity.ROW, Granularity.PAGE
NHD, HND = LayoutHints(kv_layout="NHD"), LayoutHints(kv_layout="HND")


def geom(p):
    return (p.granularity, p.dtype_name, p.rows_per_block, p.num_blocks, p.row_bytes, p.block_stride_bytes)


def test_mla_single_3d():
    t = torch.zeros(10, 16, 576, dtype=torch.bfloat16)
    lay = detect_layer("l", t)
    assert lay.format is LayerFormat.ROWS
    assert [geom(p) for p in lay.planes] == [(ROW, "bfloat16", 16, 10, 1152, 16 * 1152)]
    assert lay.planes[0].data_ptr == t.data_ptr()


def test_nhd_single_needs_a_hint():
    t = torch.zeros(10, 16, 4, 8, dtype=torch.float16)
    with pytest.raises(LayoutError) as err:
        detect_layer("model.layers.3.attn", t)
    msg = str(err.value)
    assert "model.layers.3.attn" in msg and "(10, 16, 4, 8)" in msg and "float16" in msg and "stride" in msg
    lay = detect_layer("l", t, NHD)
    assert lay.format is LayerFormat.NHD
    assert [geom(p) for p in lay.planes] == [(ROW, "float16", 16, 10, 64, 1024)]


def test_single_head_is_unambiguous():
    a = torch.zeros(10, 16, 1, 64)  # [blocks, tokens, 1, hs]
    b = torch.zeros(10, 1, 16, 64)  # [blocks, 1, tokens, C] (vLLM >= 0.32 views)
    assert geom(detect_layer("a", a).planes[0]) == (ROW, "float32", 16, 10, 256, 4096)
    assert geom(detect_layer("b", b).planes[0]) == (ROW, "float32", 16, 10, 256, 4096)


def test_hnd_permuted_view_gives_per_head_planes_without_copy():
    phys = torch.zeros(10, 4, 16, 8, dtype=torch.float16)  # [blocks, heads, tokens, hs]
    logical = phys.permute(0, 2, 1, 3)  # what vLLM hands over for HND
    assert not logical.is_contiguous()
    lay = detect_layer("l", logical, HND)
    assert lay.format is LayerFormat.HND
    assert len(lay.planes) == 4
    for h, p in enumerate(lay.planes):
        assert geom(p) == (ROW, "float16", 16, 10, 16, 4 * 16 * 16)
        assert p.head == h and p.data_ptr == phys.data_ptr() + h * 16 * 16
    v = physical_view(logical)
    assert v.is_contiguous() and v.data_ptr() == phys.data_ptr()


def test_kv_stacked_5d_both_orders():
    fa = torch.zeros(2, 10, 16, 4, 8)
    lay = detect_layer("l", fa, NHD)
    assert lay.format is LayerFormat.KV_STACKED
    assert [p.data_ptr for p in lay.planes] == [fa[0].data_ptr(), fa[1].data_ptr()]
    fi = torch.zeros(10, 2, 16, 4, 8)  # FlashInfer: blocks first
    lay = detect_layer("l", fi, NHD)
    assert [geom(p)[4:] for p in lay.planes] == [(128, 2 * 16 * 128)] * 2
    with pytest.raises(LayoutError, match="K/V dimension"):
        detect_layer("l", torch.zeros(2, 2, 16, 4, 8), NHD)


def test_kv_tuple_and_mla_tuple_and_dsa():
    k, v = torch.zeros(10, 16, 4, 8), torch.zeros(10, 16, 4, 8)
    assert detect_layer("l", (k, v)).format is LayerFormat.KV_PAIR  # tuples default to NHD
    mla = (torch.zeros(10, 16, 1, 512, dtype=torch.bfloat16), torch.zeros(10, 16, 1, 64, dtype=torch.bfloat16))
    lay = detect_layer("l", mla)
    assert lay.format is LayerFormat.TWO_PLANE and [p.row_bytes for p in lay.planes] == [1024, 128]
    dsa = mla + (torch.zeros(10, 16, 1, 128, dtype=torch.int8), torch.zeros(10, 16, 1, 1, dtype=torch.float16))
    lay = detect_layer("l", dsa)
    assert lay.format is LayerFormat.MULTI_PLANE
    assert [(p.dtype_name, p.row_bytes) for p in lay.planes] == [
        ("bfloat16", 1024), ("bfloat16", 128), ("int8", 128), ("float16", 2)
    ]


def test_heterogeneous_block_sizes():
    planes = (torch.zeros(8, 64, 584, dtype=torch.uint8), torch.zeros(8, 2, 584, dtype=torch.uint8))
    lay = detect_layer("l", planes)
    assert [p.rows_per_block for p in lay.planes] == [64, 2]


def _blob(nb=6, page=1024):
    return torch.zeros(nb * page, dtype=torch.uint8), page


def test_same_address_dtype_views_are_one_blob():
    buf, page = _blob()
    int8 = torch.as_strided(buf.view(torch.int8), (6, 4, 132), (page, 132, 1), 0)
    fp32 = torch.as_strided(buf.view(torch.float32), (6, 4, 33), (page // 4, 33, 1), 0)
    lay = detect_layer("l", (int8, fp32))
    assert len(lay.planes) == 1 and lay.aliases == ((1, 0),)
    assert lay.planes[0].row_bytes == 132 and lay.planes[0].block_stride_bytes == page


def test_slices_of_one_allocation_are_separate_planes():
    m = torch.zeros(6, 1024, dtype=torch.int8)
    conv, ssm = m[:, :256], m[:, 256:]  # Mamba-style: different addresses
    lay = detect_layer("mamba", (conv, ssm), paged=[True, True], state=[True, True])
    assert len(lay.planes) == 2 and not lay.aliases
    assert [(p.granularity, p.row_bytes, p.block_stride_bytes, p.rows_per_block) for p in lay.planes] == [
        (PAGE, 256, 1024, 0), (PAGE, 768, 1024, 0)
    ]
    assert lay.planes[1].data_ptr == m.data_ptr() + 256


def test_view_inside_another_view_is_folded():
    buf, page = _blob()
    rows = torch.as_strided(buf, (6, 4, 132), (page, 132, 1), 0)
    scale = torch.as_strided(buf, (6, 4, 4), (page, 132, 1), 128)  # not packed on its own
    lay = detect_layer("l", (rows, scale))
    assert len(lay.planes) == 1 and lay.aliases == ((1, 0),)


def test_partial_overlap_is_refused():
    buf, page = _blob()
    a = torch.as_strided(buf, (6, 4, 100), (page, 100, 1), 0)
    b = torch.as_strided(buf, (6, 4, 100), (page, 100, 1), 200)
    with pytest.raises(LayoutError, match="partly overlap"):
        detect_layer("l", (a, b))


def test_padded_block_stride():
    buf = torch.zeros(5 * 37440, dtype=torch.uint8)
    t = torch.as_strided(buf, (5, 1, 64, 584), (37440, 37440, 584, 1))
    p = detect_layer("l", t).planes[0]
    assert (p.rows_per_block, p.row_bytes, p.block_stride_bytes) == (64, 584, 37440)


def test_cpu_opaque_pages():
    t = torch.zeros(10, 2, 16, 64)  # [blocks, heads, block_size, 2*head_size]
    lay = detect_layer("l", t, LayoutHints(opaque_pages=True))
    assert lay.format is LayerFormat.PAGES
    assert geom(lay.planes[0]) == (PAGE, "float32", 16, 10, 2 * 16 * 64 * 4, 2 * 16 * 64 * 4)


def test_state_page_4d_int8():
    t = torch.zeros(10, 1, 1, 4096, dtype=torch.int8)
    p = detect_layer("l", t, paged=[True], state=[True]).planes[0]
    assert (p.granularity, p.rows_per_block, p.row_bytes) == (PAGE, 0, 4096)


@pytest.mark.parametrize(
    "entry, why",
    [
        (torch.zeros(100), "no block dimension"),
        (torch.zeros(2, 3, 4, 5, 6, 7), "not a known row layout"),
        (torch.zeros(3, 4, 5, 6, 7), "K/V dimension"),
        (torch.zeros(10, 16, 8)[:, :, :4], "not densely packed"),
        (torch.zeros(1, 16, 8).expand(10, 16, 8), "broadcast"),
        ([], "non-empty"),
        ((torch.zeros(10, 16, 8), "x"), "non-empty tuple/list of tensors"),
    ],
)
def test_unknown_layouts_are_explained(entry, why):
    with pytest.raises(LayoutError) as err:
        detect_layer("model.layers.7.attn", entry, NHD)
    msg = str(err.value)
    assert why in msg and "model.layers.7.attn" in msg


def test_error_lists_shapes_strides_dtypes():
    bad = (torch.zeros(10, 16, 8, dtype=torch.bfloat16), torch.zeros(10, 16, 8)[:, :, ::2])
    with pytest.raises(LayoutError) as err:
        detect_layer("L9", bad)
    msg = str(err.value)
    assert "shape=(10, 16, 8) stride=(128, 8, 1) dtype=bfloat16" in msg
    assert "shape=(10, 16, 4) stride=(128, 8, 2) dtype=float32" in msg


def test_hints_validation():
    with pytest.raises(ValueError, match="kv_layout"):
        LayoutHints(kv_layout="NDH")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer_compress_ratio"):
        LayoutHints(layer_compress_ratio={"x": 0})


def _ascend_indexer_page(nb=5, rows=8, k_dtype=torch.int8, scale_dtype=torch.float16, full=True):
    """vLLM-Ascend's DeepSeek-V4 indexer page: all K rows, then all scales;
    on A5 a third view of (K + scale)-byte rows restarts at the page start
    (model_runner_v1.py, _adjust_kv_layout with overlap_full_kv_cache)."""
    ksz, ssz = torch.empty(0, dtype=k_dtype).element_size(), torch.empty(0, dtype=scale_dtype).element_size()
    page = rows * (16 * ksz + ssz)
    buf = torch.zeros(nb * page, dtype=torch.uint8)
    k = torch.as_strided(buf.view(k_dtype), (nb, rows, 1, 16), (page // ksz, 16, 16, 1), 0)
    scale = torch.as_strided(buf.view(scale_dtype), (nb, rows, 1, 1), (page // ssz, 1, 1, 1), rows * 16 * ksz // ssz)
    views = [k, scale]
    if full:
        width = (16 * ksz + ssz) // ksz
        views.append(torch.as_strided(buf.view(k_dtype), (nb, rows, 1, width), (page // ksz, width, width, 1), 0))
    return views, page


def test_k_then_scale_page_is_two_row_planes():
    (k, scale), page = _ascend_indexer_page(full=False)
    lay = detect_layer("idx", [k, scale])
    assert not lay.aliases
    assert [(p.rows_per_block, p.row_bytes, p.block_stride_bytes) for p in lay.planes] == [(8, 16, page), (8, 2, page)]
    assert lay.planes[1].data_ptr - lay.planes[0].data_ptr == 8 * 16


def test_a5_full_view_over_k_and_scale_is_folded_into_them():
    """Row r of the 'full' view is not token r's bytes (K rows are 16 bytes,
    full rows 20): moving its rows would mix K and scale bytes of other
    tokens, so the K and scale planes are kept and the full view dropped."""
    views, page = _ascend_indexer_page(k_dtype=torch.float8_e4m3fn, scale_dtype=torch.float32)
    lay = detect_layer("idx", views)
    assert lay.aliases == ((2, 0),)
    assert [(p.element, p.row_bytes) for p in lay.planes] == [(0, 16), (1, 4)]
    assert lay.format is LayerFormat.MULTI_PLANE


def test_reinterpreting_view_that_others_do_not_tile_is_refused():
    views, page = _ascend_indexer_page(k_dtype=torch.float8_e4m3fn, scale_dtype=torch.float32)
    with pytest.raises(LayoutError, match="do not tile its block") as err:
        detect_layer("idx", [views[0], views[2]])  # K alone under the full view: scales unaccounted
    assert "idx" in str(err.value) and "float8_e4m3fn" in str(err.value)
