# SPDX-License-Identifier: Apache-2.0
# Installs the build tree into a fresh prefix and runs the installed executables from there, in an
# environment without LD_LIBRARY_PATH, as a user who ran `cmake --install` would: each must find
# libtaskswap and its other libraries by itself. PROGRAMS is a '|'-separated list of
# "name args..." entries (args separated by spaces).

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok\n${out}")
endfunction()

set(config_args)
if(CONFIG)
  set(config_args --config ${CONFIG})
endif()
run_step("install" ${CMAKE_COMMAND} --install "${TASKSWAP_BUILD_DIR}" --prefix "${prefix}" ${config_args})
string(REPLACE "|" ";" programs "${PROGRAMS}")
foreach(entry IN LISTS programs)
  separate_arguments(command UNIX_COMMAND "${entry}")
  list(POP_FRONT command name)
  set(exe "${prefix}/bin/${name}")
  if(NOT EXISTS "${exe}")
    message(FATAL_ERROR "${exe} was not installed")
  endif()
  run_step("${name} ${command} (installed)" ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH "${exe}" ${command})
endforeach()
