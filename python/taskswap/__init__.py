# SPDX-License-Identifier: Apache-2.0
"""taskswap: per-task state swapping for multi-task training.

``taskswap`` is the runtime itself (the C++ library, bound without libtorch); ``taskswap.torch``
is the layer a PyTorch trainer uses (registers modules, aliases their parameters and gradients
into the unit slabs, steps on torch's current stream).
"""

import importlib.util as _importlib_util
import os as _os

from ._core import (  # noqa: F401
    AdamW,
    Average,
    Backend,
    CheckpointError,
    CommBackend,
    CommError,
    CommOptions,
    Communicator,
    ConfigError,
    CudaError,
    Device,
    DeviceError,
    DeviceOptions,
    DiskStats,
    DType,
    Error,
    InvalidArgument,
    OptimizerPlacement,
    Options,
    OutOfMemory,
    Residency,
    Runtime,
    RuntimeStats,
    StepStats,
    StorageError,
    StorageOptions,
    Stream,
    TensorSpec,
    TimeoutError,
    UnitFootprint,
    UnitPolicy,
    UnitSpec,
    UnitState,
    UnitStats,
    __version__,
    cuda_device_count,
    external_stream,
    footprint,
    load_config,
    make_communicator,
    make_device,
    mpi_communicator,
    nccl_communicator,
    nccl_library,
    nccl_unique_id,
    parse_config,
    parse_size,
    policy_for,
    prefer_nccl_library,
    with_cuda,
    with_mpi,
    with_nccl,
)


def _prefer_the_wheels_nccl() -> None:
    """PyTorch's wheels load the `nvidia-nccl` wheel's libnccl.so.2. taskswap loads NCCL only when
    it first needs it, and takes one the process has loaded already (torch's, once imported); if
    taskswap needs it before torch is imported, it takes the wheel's too, so that torch, imported
    later, finds the NCCL it was built for (Note [NCCL at run time], comm/nccl_library.hpp)."""
    try:
        spec = _importlib_util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        library = _os.path.join(folder, "lib", "libnccl.so.2")
        if _os.path.exists(library):
            prefer_nccl_library(library)
            return


if with_nccl:
    _prefer_the_wheels_nccl()
