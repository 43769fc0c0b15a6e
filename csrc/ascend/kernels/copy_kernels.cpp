// SPDX-License-Identifier: Apache-2.0
// AscendC entry points (compiled by CANN's ascendc_library; see
// csrc/ascend/ascend.cmake).  Each builds its kernel object on a TPipe and
// runs it; the bodies live in copy_kernels.h.  Launch arguments are GM
// addresses; scalars travel in the int64 meta array (kernel_meta.h).
#include "copy_kernels.h"

extern "C" __global__ __aicore__ void lmca_token_rows_kernel(
    GM_ADDR meta, GM_ADDR layer_ptrs, GM_ADDR chunk, GM_ADDR slots) {
  AscendC::TPipe pipe;
  lmca::TokenRowsKernel kernel;
  kernel.Init(&pipe, meta, layer_ptrs, chunk, slots);
  kernel.Process();
}

extern "C" __global__ __aicore__ void lmca_multi_plane_kernel(GM_ADDR meta,
                                                              GM_ADDR chunk,
                                                              GM_ADDR slots) {
  AscendC::TPipe pipe;
  lmca::MultiPlaneKernel kernel;
  kernel.Init(&pipe, meta, chunk, slots);
  kernel.Process();
}

extern "C" __global__ __aicore__ void lmca_block_pages_kernel(
    GM_ADDR meta, GM_ADDR chunk, GM_ADDR block_ids) {
  AscendC::TPipe pipe;
  lmca::BlockPagesKernel kernel;
  kernel.Init(&pipe, meta, chunk, block_ids);
  kernel.Process();
}
