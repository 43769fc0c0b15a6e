// SPDX-License-Identifier: Apache-2.0
// Ascend backend placeholder for builds without a CANN toolkit.  The op layer
// checks built() and raises a clear RuntimeError before reaching these; they
// throw as well so that a wrong call can never silently do nothing.
#include <stdexcept>

#include "ops/backend_ascend.h"

namespace lmca::ascend {
namespace {
[[noreturn]] void not_built() {
  throw std::runtime_error(
      "lmcache_ascend.ops: the NPU (Ascend) backend was not compiled into "
      "this build (no CANN toolkit was found at build time)");
}
}  // namespace

bool built() { return false; }
void token_rows(const TokenRowsLaunch&) { not_built(); }
void multi_plane(const MultiPlaneLaunch&) { not_built(); }
void block_pages(const BlockPagesLaunch&) { not_built(); }
void memcpy_async(uint64_t, uint64_t, int64_t, bool) { not_built(); }

}  // namespace lmca::ascend
