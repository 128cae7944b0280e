# SPDX-License-Identifier: Apache-2.0
# Shared by the install tests: run_step(what, command...) fails the test with the command's output,
# and the build tree (TASKSWAP_BUILD_DIR, CONFIG) is installed into a fresh ${prefix} under WORK_DIR.

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok\n${out}")
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
set(config_args)
if(CONFIG)
  set(config_args --config ${CONFIG})
endif()
run_step("install" ${CMAKE_COMMAND} --install "${TASKSWAP_BUILD_DIR}" --prefix "${prefix}" ${config_args})
