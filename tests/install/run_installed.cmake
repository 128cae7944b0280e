# SPDX-License-Identifier: Apache-2.0
# Installs the build tree into a fresh prefix and runs the installed executables from there, in an
# environment without LD_LIBRARY_PATH, as a user who ran `cmake --install` would: each must find
# libtaskswap and its other libraries by itself. PROGRAMS is a '|'-separated list of
# "name args..." entries (args separated by spaces).

include(${CMAKE_CURRENT_LIST_DIR}/install_prefix.cmake)
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
