# SPDX-License-Identifier: Apache-2.0
# Ascend backend: AscendC kernels (ascendc_library) + host launchers linked
# into the `ops` module.  Included by CMakeLists.txt only when a CANN toolkit
# with ascendc.cmake was found (LMCA_CANN_PATH, LMCA_ASCENDC_CMAKE_DIR).
#   SOC_VERSION: target chip, default Ascend910B1 (env LMCA_SOC_VERSION).
#   torch_npu: located through the build interpreter.

if(NOT SOC_VERSION)
  if(DEFINED ENV{LMCA_SOC_VERSION})
    set(SOC_VERSION "$ENV{LMCA_SOC_VERSION}")
  else()
    set(SOC_VERSION "Ascend910B1")
  endif()
endif()
set(SOC_VERSION "${SOC_VERSION}" CACHE STRING "Ascend SoC the kernels are built for")
# The kernels move data with DataCopyPad between GM and UB, which Atlas
# inference products (Ascend310P*) lack (DataCopyPad docs); the launchers
# refuse such a SoC at run time too.
if(SOC_VERSION MATCHES "^Ascend310P")
  message(FATAL_ERROR "lmcache_ascend: SOC_VERSION ${SOC_VERSION} (Atlas 300I Duo / 310P) "
                      "has no DataCopyPad between GM and UB, which every copy kernel "
                      "uses; build for an Atlas A2/A3 SoC (Ascend910B*, Ascend910_93*) "
                      "or set LMCA_DISABLE_ASCEND=1 for a CPU-only build")
endif()
set(ASCEND_CANN_PACKAGE_PATH "${LMCA_CANN_PATH}")
set(RUN_MODE "npu")
include("${LMCA_ASCENDC_CMAKE_DIR}/ascendc.cmake")

ascendc_library(lmca_ascend_kernels STATIC
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/ascend/kernels/copy_kernels.cpp)
ascendc_include_directories(lmca_ascend_kernels PRIVATE
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/include
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/ascend/kernels)

execute_process(
  COMMAND ${Python3_EXECUTABLE} -c
          "import os, torch_npu; print(os.path.dirname(torch_npu.__file__))"
  OUTPUT_VARIABLE LMCA_TORCH_NPU_PATH OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _torch_npu_rc)
if(NOT _torch_npu_rc EQUAL 0)
  message(FATAL_ERROR "lmcache_ascend: CANN found at ${LMCA_CANN_PATH} but torch_npu "
                      "is not importable by ${Python3_EXECUTABLE}; install torch_npu "
                      "or unset ASCEND_HOME_PATH/ASCEND_TOOLKIT_HOME for a CPU-only build")
endif()

if(CMAKE_SYSTEM_PROCESSOR STREQUAL "aarch64")
  set(_lmca_arch "aarch64-linux")
else()
  set(_lmca_arch "x86_64-linux")
endif()

target_sources(ops PRIVATE csrc/ascend/launchers.cpp)
target_include_directories(ops PRIVATE
    csrc/ascend
    ${LMCA_TORCH_NPU_PATH}/include
    ${LMCA_CANN_PATH}/include
    ${LMCA_CANN_PATH}/${_lmca_arch}/include
    ${LMCA_CANN_PATH}/${_lmca_arch}/include/experiment/platform)
target_link_directories(ops PRIVATE
    ${LMCA_TORCH_NPU_PATH}/lib
    ${LMCA_CANN_PATH}/lib64
    ${LMCA_CANN_PATH}/${_lmca_arch}/lib64)
target_link_libraries(ops PRIVATE lmca_ascend_kernels torch_npu ascendcl platform)
message(STATUS "lmcache_ascend: Ascend kernels for ${SOC_VERSION} "
               "(CANN ${LMCA_CANN_PATH}, torch_npu ${LMCA_TORCH_NPU_PATH})")
