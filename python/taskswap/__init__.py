# SPDX-License-Identifier: Apache-2.0
"""taskswap: per-task state swapping for multi-task training.

``taskswap`` is the runtime itself (the C++ library, bound without libtorch); ``taskswap.torch``
is the layer a PyTorch trainer uses (registers modules, aliases their parameters and gradients
into the unit slabs, steps on torch's current stream).
"""

from ._core import (  # noqa: F401
    AdamW, Average, Backend, CheckpointError, CommBackend, CommError, CommOptions, Communicator,
    ConfigError, CudaError, Device, DeviceError, DeviceOptions, DType, Error, InvalidArgument, Options,
    OptimizerPlacement, OutOfMemory, Residency, Runtime, RuntimeStats, StepStats, Stream, TensorSpec,
    TimeoutError, UnitFootprint, UnitPolicy, UnitSpec, UnitState, UnitStats, __version__, cuda_device_count,
    external_stream, footprint, load_config, make_communicator, make_device, mpi_communicator,
    nccl_communicator, nccl_unique_id, parse_config, parse_size, policy_for, with_cuda, with_mpi, with_nccl)
