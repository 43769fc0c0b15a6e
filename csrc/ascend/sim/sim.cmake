# SPDX-License-Identifier: Apache-2.0
# lmcache_ascend._ascend_sim: the AscendC kernels (csrc/ascend/kernels) built
# by the host compiler against the AscendC simulation (this directory), behind
# the op layer's own validation and Ascend lowering (csrc/ops_*.cpp, compiled
# again for this module; its backend selection is replaced, see
# sim_ops_util.cpp).  Included by CMakeLists.txt when LMCA_BUILD_ASCEND_SIM.

set(LMCA_SIM_SOURCES
    csrc/ascend/sim/sim_module.cpp
    csrc/ascend/sim/sim_backend.cpp
    csrc/ascend/sim/sim_ops_util.cpp
    csrc/ascend/sim/violation_kernels.cpp
    csrc/ascend/kernels/copy_kernels.cpp
    csrc/ops_lmcache.cpp
    csrc/ops_block.cpp
    csrc/ops_planes.cpp
    csrc/cpu/row_engine.cpp)

Python3_add_library(_ascend_sim MODULE WITH_SOABI ${LMCA_SIM_SOURCES})
# First on the path: the kernels' "kernel_operator.h" must resolve to the
# simulation's, never to a CANN toolkit's.
target_include_directories(_ascend_sim BEFORE PRIVATE csrc/ascend/sim)
target_include_directories(_ascend_sim PRIVATE csrc csrc/include csrc/ascend
                                               csrc/ascend/kernels)
target_link_libraries(_ascend_sim PRIVATE lmca_torch)
target_compile_options(_ascend_sim PRIVATE -fvisibility=hidden -Wall -Wno-unused-parameter)
if(LMCA_OUTPUT_DIR)
  # Next to the ops module (the source package in editable builds).
  set_target_properties(_ascend_sim PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${LMCA_OUTPUT_DIR}")
endif()
