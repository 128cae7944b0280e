# SPDX-License-Identifier: Apache-2.0
#[=======================================================================[.rst:
FindNCCL
--------

Finds the NVIDIA Collective Communications Library. Looks, in order, in
``NCCL_ROOT`` (variable or environment), the CUDA toolkit, the ``nvidia/nccl``
folder of an installed Python package (where PyTorch's wheels keep it), and
the usual prefixes.

Defines the imported target ``NCCL::NCCL`` and ``NCCL_FOUND``,
``NCCL_INCLUDE_DIR``, ``NCCL_LIBRARY``, ``NCCL_VERSION``.
#]=======================================================================]

set(_nccl_hints)
foreach(_root IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "$ENV{NCCL_HOME}")
  if(_root)
    list(APPEND _nccl_hints "${_root}")
  endif()
endforeach()

if(NOT CUDAToolkit_FOUND)
  find_package(CUDAToolkit QUIET)
endif()
if(CUDAToolkit_FOUND)
  list(APPEND _nccl_hints "${CUDAToolkit_LIBRARY_ROOT}" "${CUDAToolkit_TARGET_DIR}")
endif()

# nvidia/nccl from pip (nvidia-nccl-cu12 and friends, PyTorch's dependency).
find_package(Python3 QUIET COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
      "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])"
    OUTPUT_VARIABLE _nccl_python_dir OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET RESULT_VARIABLE _nccl_python_rc)
  if(_nccl_python_rc EQUAL 0 AND IS_DIRECTORY "${_nccl_python_dir}")
    list(APPEND _nccl_hints "${_nccl_python_dir}")
  endif()
endif()

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_nccl_hints}
  PATH_SUFFIXES include
  PATHS /usr/local/cuda /usr/local /usr /opt/nccl)
# Python wheels ship only libnccl.so.2, without the unversioned link.
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
  HINTS ${_nccl_hints}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu
  PATHS /usr/local/cuda /usr/local /usr /opt/nccl)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines REGEX "#define NCCL_(MAJOR|MINOR|PATCH) ")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define NCCL_${_part} ([0-9]+).*" "\\1" _nccl_${_part} "${_nccl_version_lines}")
  endforeach()
  set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
