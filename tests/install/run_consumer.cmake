# SPDX-License-Identifier: Apache-2.0
# Installs the build tree into a fresh prefix, then configures, builds and runs a consumer project
# that does find_package(taskswap CONFIG REQUIRED), as a user's project would: the consumer of
# tests/install, or the sample trainer.

include(${CMAKE_CURRENT_LIST_DIR}/install_prefix.cmake)
run_step("configure consumer" ${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build"
  -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_BUILD_TYPE=Release
  # the same instrumentation as the library (sanitizer presets)
  "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${EXE_LINKER_FLAGS}")
run_step("build consumer" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
# EXECUTABLE and RUN_ARGS ('|'-separated) name another program of the project and its arguments.
if(NOT EXECUTABLE)
  set(EXECUTABLE consumer)
endif()
string(REPLACE "|" ";" run_args "${RUN_ARGS}")
run_step("run consumer" "${WORK_DIR}/build/${EXECUTABLE}" ${run_args})
