# SPDX-License-Identifier: Apache-2.0
# Resolution of the AUTO/ON/OFF options and the project's warning set.

# Fails configuration when a feature set to ON cannot be built; AUTO turns it off quietly.
function(_taskswap_require option found what)
  if(${option} STREQUAL "ON" AND NOT ${found})
    message(FATAL_ERROR "${option}=ON but ${what}; install it or set ${option}=OFF (or AUTO)")
  endif()
endfunction()

macro(taskswap_resolve_cuda)
  set(TASKSWAP_WITH_CUDA OFF)
  if(NOT TASKSWAP_CUDA STREQUAL "OFF")
    include(CheckLanguage)
    check_language(CUDA)
    find_package(CUDAToolkit QUIET)
    if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
        # H100 and H200; override with -DCMAKE_CUDA_ARCHITECTURES=...
        set(CMAKE_CUDA_ARCHITECTURES 90)
      endif()
      enable_language(CUDA)
      # CMake 3.25's NVIDIA module knows CUDA dialects up to C++17; nvcc 12+ takes -std=c++20.
      if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
        set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
        set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
        list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
      endif()
      set(CMAKE_CUDA_STANDARD 20)
      set(CMAKE_CUDA_STANDARD_REQUIRED ON)
      set(TASKSWAP_WITH_CUDA ON)
    endif()
    _taskswap_require(TASKSWAP_CUDA TASKSWAP_WITH_CUDA "no CUDA compiler and toolkit were found")
  endif()
endmacro()

macro(taskswap_resolve_nccl)
  set(TASKSWAP_WITH_NCCL OFF)
  if(NOT TASKSWAP_NCCL STREQUAL "OFF" AND TASKSWAP_WITH_CUDA)
    find_package(NCCL QUIET)
    if(NCCL_FOUND)
      set(TASKSWAP_WITH_NCCL ON)
    endif()
  endif()
  if(TASKSWAP_NCCL STREQUAL "ON")
    _taskswap_require(TASKSWAP_NCCL TASKSWAP_WITH_NCCL
      "NCCL was not found (it needs TASKSWAP_CUDA; set NCCL_ROOT to its prefix)")
  endif()
endmacro()

macro(taskswap_resolve_mpi)
  set(TASKSWAP_WITH_MPI OFF)
  if(NOT TASKSWAP_MPI STREQUAL "OFF")
    find_package(MPI QUIET COMPONENTS CXX)
    if(MPI_CXX_FOUND)
      set(TASKSWAP_WITH_MPI ON)
    endif()
    _taskswap_require(TASKSWAP_MPI TASKSWAP_WITH_MPI "MPI was not found (apt-get install libopenmpi-dev)")
  endif()
endmacro()

# The warning set, for C++ and CUDA alike; errors with TASKSWAP_WERROR (the presets and CI).
function(taskswap_warnings target)
  set(cxx_flags -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Wcast-align
                -Woverloaded-virtual -Wconversion -Wsign-conversion -Wnull-dereference)
  set(cuda_flags -Xcompiler=-Wall,-Wextra)
  if(TASKSWAP_WERROR)
    list(APPEND cxx_flags -Werror)
    list(APPEND cuda_flags -Werror=all-warnings -Xcompiler=-Werror)
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${cxx_flags}>
    $<$<COMPILE_LANGUAGE:CUDA>:${cuda_flags}>)
endfunction()

# The Python package (python/): a nanobind extension and the pure-Python torch layer. AUTO builds
# it when an interpreter with its headers and nanobind is found (tools/setup makes the venv
# build/venv that the presets point Python_EXECUTABLE at); it never links libtorch.
macro(taskswap_resolve_python)
  set(TASKSWAP_WITH_PYTHON OFF)
  if(NOT TASKSWAP_PYTHON STREQUAL "OFF")
    find_package(Python 3.9 QUIET COMPONENTS Interpreter Development.Module)
    set(_taskswap_nanobind_dir "")
    if(Python_FOUND)
      execute_process(COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
        OUTPUT_VARIABLE _taskswap_nanobind_dir OUTPUT_STRIP_TRAILING_WHITESPACE
        ERROR_QUIET RESULT_VARIABLE _taskswap_nanobind_rc)
      if(_taskswap_nanobind_rc EQUAL 0 AND EXISTS "${_taskswap_nanobind_dir}")
        list(APPEND CMAKE_PREFIX_PATH "${_taskswap_nanobind_dir}")
        find_package(nanobind CONFIG QUIET)
        if(nanobind_FOUND)
          set(TASKSWAP_WITH_PYTHON ON)
        endif()
      endif()
    endif()
    _taskswap_require(TASKSWAP_PYTHON TASKSWAP_WITH_PYTHON
      "no Python interpreter with its headers and nanobind was found (run tools/setup, or set Python_EXECUTABLE to an interpreter that has nanobind)")
    if(NOT TASKSWAP_WITH_PYTHON)
      message(STATUS "taskswap: the Python package is not built (no interpreter with headers and nanobind; tools/setup makes build/venv)")
    endif()
  endif()
endmacro()
