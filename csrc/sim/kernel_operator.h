// SPDX-License-Identifier: Apache-2.0
// Stand-in for CANN's kernel_operator.h in the host (simulation) build.
// The simulation target puts this directory first on its include path, so
// the kernels' `#include "kernel_operator.h"` selects the AscendC simulation
// here and CANN's header in the NPU build; the kernel sources are the same.
#pragma once

#include "ascendc_sim.h"
