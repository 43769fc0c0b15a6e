# SPDX-License-Identifier: Apache-2.0
# lmca_ascend_sim (tests only): the AscendC kernels (csrc/ascend/kernels)
# built by the host compiler against the AscendC simulation (this directory),
# behind the op layer (lmca_op_layer, the same objects as lmcache_ascend._ops)
# with this module's own backend seam (sim_backend.cpp: pick_backend and the
# lmca::ascend launchers).  Included by CMakeLists.txt when
# LMCA_BUILD_ASCEND_SIM.  Written to LMCA_SIM_OUTPUT_DIR (default
# <source>/build/ascend-sim), where tests/kernels/sim_module.py finds it.

set(LMCA_SIM_OUTPUT_DIR "${PROJECT_SOURCE_DIR}/build/ascend-sim" CACHE PATH
    "Folder of the test-only AscendC simulation module")

Python3_add_library(lmca_ascend_sim MODULE WITH_SOABI
    csrc/sim/sim_module.cpp
    csrc/sim/sim_backend.cpp
    csrc/sim/violation_kernels.cpp
    csrc/ascend/kernels/copy_kernels.cpp)
# First on the path: the kernels' "kernel_operator.h" must resolve to the
# simulation's, never to a CANN toolkit's.
target_include_directories(lmca_ascend_sim BEFORE PRIVATE csrc/sim)
target_include_directories(lmca_ascend_sim PRIVATE csrc/ascend/kernels)
target_link_libraries(lmca_ascend_sim PRIVATE lmca_op_layer)
target_compile_options(lmca_ascend_sim PRIVATE -fvisibility=hidden -Wall -Wno-unused-parameter)
set_target_properties(lmca_ascend_sim PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${LMCA_SIM_OUTPUT_DIR}")
# Its type stub travels with it (IDEs that add the folder find both).
configure_file(csrc/sim/lmca_ascend_sim.pyi "${LMCA_SIM_OUTPUT_DIR}/lmca_ascend_sim.pyi" COPYONLY)
