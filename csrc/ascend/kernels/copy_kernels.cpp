// SPDX-License-Identifier: Apache-2.0
// AscendC entry points (compiled by CANN's ascendc_library; see
// csrc/ascend/ascend.cmake).  Each builds its kernel object on a TPipe and
// runs it; the bodies live in copy_kernels.h.  Launch arguments are GM
// addresses; scalars travel in the int64 meta array (kernel_meta.h).
//
// Every entry is declared AIV-only (vector cores only; "设置Kernel类型"
// docs) and returns at once on a core index past GetBlockNum(): were the
// kernel ever launched MIX (AIC:AIV 1:2), the vector cores' GetBlockIdx()
// would span [0, 2 * GetBlockNum()) and the extra ones would split work
// that is not there.
#include "copy_kernels.h"

extern "C" __global__ __aicore__ void lmca_token_rows_kernel(
    GM_ADDR meta, GM_ADDR layer_ptrs, GM_ADDR chunk, GM_ADDR slots) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  if (AscendC::GetBlockIdx() >= AscendC::GetBlockNum()) return;
  AscendC::TPipe pipe;
  lmca::TokenRowsKernel kernel;
  kernel.Init(&pipe, meta, layer_ptrs, chunk, slots);
  kernel.Process();
}

extern "C" __global__ __aicore__ void lmca_multi_plane_kernel(GM_ADDR meta,
                                                              GM_ADDR chunk,
                                                              GM_ADDR slots) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  if (AscendC::GetBlockIdx() >= AscendC::GetBlockNum()) return;
  AscendC::TPipe pipe;
  lmca::MultiPlaneKernel kernel;
  kernel.Init(&pipe, meta, chunk, slots);
  kernel.Process();
}

extern "C" __global__ __aicore__ void lmca_block_pages_kernel(
    GM_ADDR meta, GM_ADDR chunk, GM_ADDR block_ids) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  if (AscendC::GetBlockIdx() >= AscendC::GetBlockNum()) return;
  AscendC::TPipe pipe;
  lmca::BlockPagesKernel kernel;
  kernel.Init(&pipe, meta, chunk, block_ids);
  kernel.Process();
}
