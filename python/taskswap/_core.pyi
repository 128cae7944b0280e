"""
taskswap's runtime for Python (no libtorch link; views are DLPack tensors)
"""

from collections.abc import Mapping, Sequence
import enum
import os
import pathlib

import torch

from taskswap import (
    CheckpointError as CheckpointError,
    CommError as CommError,
    ConfigError as ConfigError,
    CudaError as CudaError,
    DeviceError as DeviceError,
    Error as Error,
    InvalidArgument as InvalidArgument,
    OutOfMemory as OutOfMemory,
    StorageError as StorageError,
    TimeoutError as TimeoutError
)


class DType(enum.Enum):
    """Element types of a unit's slabs."""

    f32 = 0

    bf16 = 1

    f16 = 2

    u8 = 3

class Residency(enum.Enum):
    """Where a unit lives between uses."""

    pinned = 0

    prefetch = 1

    on_demand = 2

class OptimizerPlacement(enum.Enum):
    """Where a unit's AdamW step runs."""

    device = 0

    host = 1

class Backend(enum.Enum):
    """A device backend."""

    cuda = 0

    emulated = 1

class Average(enum.Enum):
    """What reduced gradients are divided by."""

    contributors = 0

    world = 1

class CommBackend(enum.Enum):
    """The communicator a config names."""

    none = 0

    nccl = 1

    mpi = 2

class UnitState(enum.Enum):
    """Where a unit is now."""

    home = 0

    resident = 1

    held = 2

class AdamW:
    """AdamW hyperparameters."""

    def __init__(self) -> None: ...

    @property
    def lr(self) -> float: ...

    @lr.setter
    def lr(self, arg: float, /) -> None: ...

    @property
    def beta1(self) -> float: ...

    @beta1.setter
    def beta1(self, arg: float, /) -> None: ...

    @property
    def beta2(self) -> float: ...

    @beta2.setter
    def beta2(self, arg: float, /) -> None: ...

    @property
    def eps(self) -> float: ...

    @eps.setter
    def eps(self, arg: float, /) -> None: ...

    @property
    def weight_decay(self) -> float: ...

    @weight_decay.setter
    def weight_decay(self, arg: float, /) -> None: ...

    @property
    def clip(self) -> float:
        """Global-norm gradient clipping (0: none)."""

    @clip.setter
    def clip(self, arg: float, /) -> None: ...

class LossScaler:
    """Dynamic loss scaling, as torch.cuda.amp.GradScaler."""

    def __init__(self) -> None: ...

    @property
    def enabled(self) -> bool: ...

    @enabled.setter
    def enabled(self, arg: bool, /) -> None: ...

    @property
    def init_scale(self) -> float: ...

    @init_scale.setter
    def init_scale(self, arg: float, /) -> None: ...

    @property
    def growth_factor(self) -> float: ...

    @growth_factor.setter
    def growth_factor(self, arg: float, /) -> None: ...

    @property
    def backoff_factor(self) -> float: ...

    @backoff_factor.setter
    def backoff_factor(self, arg: float, /) -> None: ...

    @property
    def growth_interval(self) -> int: ...

    @growth_interval.setter
    def growth_interval(self, arg: int, /) -> None: ...

class LossScalerState:
    """The loss scaler's state and the last step's norm."""

    @property
    def scale(self) -> float: ...

    @property
    def growth_tracker(self) -> int: ...

    @property
    def skipped_steps(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def last_skipped(self) -> bool: ...

    @property
    def last_norm(self) -> float: ...

class UnitPolicy:
    """A unit's residency, optimizer placement and hyperparameters."""

    def __init__(self) -> None: ...

    @property
    def residency(self) -> Residency: ...

    @residency.setter
    def residency(self, arg: Residency, /) -> None: ...

    @property
    def lookahead(self) -> int: ...

    @lookahead.setter
    def lookahead(self, arg: int, /) -> None: ...

    @property
    def optimizer(self) -> OptimizerPlacement: ...

    @optimizer.setter
    def optimizer(self, arg: OptimizerPlacement, /) -> None: ...

    @property
    def lr_scale(self) -> float: ...

    @lr_scale.setter
    def lr_scale(self, arg: float, /) -> None: ...

    @property
    def weight_decay(self) -> float | None: ...

    @weight_decay.setter
    def weight_decay(self, arg: float | None, /) -> None: ...

    @property
    def home(self) -> str:
        """
        The home tier that keeps its home copy ("host", or "disk" with Options.storage).
        """

    @home.setter
    def home(self, arg: str, /) -> None: ...

class EmulatedOptions:
    """The emulated device's memory and link model."""

    @property
    def memory_bytes(self) -> int: ...

    @memory_bytes.setter
    def memory_bytes(self, arg: int, /) -> None: ...

    @property
    def granularity(self) -> int: ...

    @granularity.setter
    def granularity(self, arg: int, /) -> None: ...

    @property
    def link_bytes_per_second(self) -> float: ...

    @link_bytes_per_second.setter
    def link_bytes_per_second(self, arg: float, /) -> None: ...

    @property
    def link_latency_s(self) -> float: ...

    @link_latency_s.setter
    def link_latency_s(self, arg: float, /) -> None: ...

class DeviceOptions:
    """Which device, and the budget."""

    def __init__(self) -> None: ...

    @property
    def backend(self) -> Backend: ...

    @backend.setter
    def backend(self, arg: Backend, /) -> None: ...

    @property
    def index(self) -> int: ...

    @index.setter
    def index(self, arg: int, /) -> None: ...

    @property
    def budget(self) -> int: ...

    @budget.setter
    def budget(self, arg: int, /) -> None: ...

    @property
    def emulated(self) -> EmulatedOptions: ...

    @emulated.setter
    def emulated(self, arg: EmulatedOptions, /) -> None: ...

class CommOptions:
    """The [comm] table."""

    def __init__(self) -> None: ...

    @property
    def backend(self) -> CommBackend: ...

    @backend.setter
    def backend(self, arg: CommBackend, /) -> None: ...

    @property
    def bucket_cap(self) -> int: ...

    @bucket_cap.setter
    def bucket_cap(self, arg: int, /) -> None: ...

    @property
    def average(self) -> Average: ...

    @average.setter
    def average(self, arg: Average, /) -> None: ...

    @property
    def reduce_every_unit(self) -> bool: ...

    @reduce_every_unit.setter
    def reduce_every_unit(self, arg: bool, /) -> None: ...

    @property
    def timeout_s(self) -> float: ...

    @timeout_s.setter
    def timeout_s(self, arg: float, /) -> None: ...

class StorageOptions:
    """
    The [storage] table: the disk home tier's directory, host cache and requests.
    """

    def __init__(self) -> None: ...

    @property
    def path(self) -> pathlib.Path:
        """The directory of the unit files (made if missing)."""

    @path.setter
    def path(self, arg: str | os.PathLike, /) -> None: ...

    @property
    def host_cache(self) -> int:
        """
        Pinned host bytes caching disk homes; at least the largest disk-homed unit.
        """

    @host_cache.setter
    def host_cache(self, arg: int, /) -> None: ...

    @property
    def queue_depth(self) -> int:
        """Reads and writes in flight at once."""

    @queue_depth.setter
    def queue_depth(self, arg: int, /) -> None: ...

    @property
    def block(self) -> int:
        """Bytes per request, a multiple of 4 KiB."""

    @block.setter
    def block(self, arg: int, /) -> None: ...

    @property
    def lookahead(self) -> int:
        """Steps ahead the plan's disk homes are read into the host cache."""

    @lookahead.setter
    def lookahead(self, arg: int, /) -> None: ...

    @property
    def timeout_s(self) -> float:
        """
        Seconds a wait for the drive may go with no request answered before a StorageError.
        """

    @timeout_s.setter
    def timeout_s(self, arg: float, /) -> None: ...

class Options:
    """Everything a taskswap TOML configuration holds."""

    def __init__(self) -> None: ...

    def __copy__(self) -> Options: ...

    def __deepcopy__(self, memo: object) -> Options: ...

    @property
    def device(self) -> DeviceOptions: ...

    @device.setter
    def device(self, arg: DeviceOptions, /) -> None: ...

    @property
    def defaults(self) -> UnitPolicy: ...

    @defaults.setter
    def defaults(self, arg: UnitPolicy, /) -> None: ...

    @property
    def optimizer(self) -> AdamW: ...

    @optimizer.setter
    def optimizer(self, arg: AdamW, /) -> None: ...

    @property
    def scaler(self) -> LossScaler: ...

    @scaler.setter
    def scaler(self, arg: LossScaler, /) -> None: ...

    @property
    def comm(self) -> CommOptions: ...

    @comm.setter
    def comm(self, arg: CommOptions, /) -> None: ...

    @property
    def storage(self) -> StorageOptions: ...

    @storage.setter
    def storage(self, arg: StorageOptions, /) -> None: ...

    @property
    def measure_stall(self) -> bool: ...

    @measure_stall.setter
    def measure_stall(self, arg: bool, /) -> None: ...

    @property
    def trace(self) -> bool: ...

    @trace.setter
    def trace(self, arg: bool, /) -> None: ...

    @property
    def source(self) -> str: ...

    @source.setter
    def source(self, arg: str, /) -> None: ...

    @property
    def rules(self) -> int:
        """The number of [[units]] rules."""

    def add_rule(self, match: str, residency: Residency | None = None, lookahead: int | None = None, optimizer: OptimizerPlacement | None = None, lr_scale: float | None = None, weight_decay: float | None = None, origin: str = 'python', home: str | None = None) -> None:
        """
        Appends a [[units]] rule (later rules win); `origin` names it in error messages; `home`: the home tier ("host" or "disk", which needs `storage`).
        """

    @property
    def timeout_s(self) -> float: ...

    @timeout_s.setter
    def timeout_s(self, arg: float, /) -> None: ...

    @property
    def optimizer_threads(self) -> int: ...

    @optimizer_threads.setter
    def optimizer_threads(self, arg: int, /) -> None: ...

    @property
    def numa_node(self) -> int: ...

    @numa_node.setter
    def numa_node(self, arg: int, /) -> None: ...

class TensorSpec:
    """A named tensor of a unit."""

    def __init__(self, name: str, shape: Sequence[int], no_weight_decay: bool = False, state: bool = False) -> None: ...

    @property
    def name(self) -> str: ...

    @name.setter
    def name(self, arg: str, /) -> None: ...

    @property
    def shape(self) -> list[int]: ...

    @shape.setter
    def shape(self, arg: Sequence[int], /) -> None: ...

    @property
    def no_weight_decay(self) -> bool: ...

    @no_weight_decay.setter
    def no_weight_decay(self, arg: bool, /) -> None: ...

    @property
    def state(self) -> bool:
        """
        A non-trainable state tensor: travels and is written home with the update; never stepped or reduced.
        """

    @state.setter
    def state(self, arg: bool, /) -> None: ...

class UnitSpec:
    """What a trainer registers: a named set of tensors."""

    def __init__(self, name: str, tensors: Sequence[TensorSpec], compute: DType = DType.f32, grad: DType | None = None, policy: UnitPolicy | None = None, trainable: bool = True, activation: bool = False) -> None: ...

    @property
    def name(self) -> str: ...

    @name.setter
    def name(self, arg: str, /) -> None: ...

    @property
    def tensors(self) -> list[TensorSpec]: ...

    @tensors.setter
    def tensors(self, arg: Sequence[TensorSpec], /) -> None: ...

    @property
    def compute(self) -> DType: ...

    @compute.setter
    def compute(self, arg: DType, /) -> None: ...

    @property
    def grad(self) -> DType | None: ...

    @grad.setter
    def grad(self, arg: DType | None, /) -> None: ...

    @property
    def policy(self) -> UnitPolicy | None: ...

    @policy.setter
    def policy(self, arg: UnitPolicy | None, /) -> None: ...

    @property
    def trainable(self) -> bool:
        """
        False: never trained (a frozen base): the parameters alone at home and on the device, every use frozen.
        """

    @trainable.setter
    def trainable(self, arg: bool, /) -> None: ...

    @property
    def activation(self) -> bool:
        """
        An activation block: written in a stash use, read back in frozen uses; never trained, homed on the host.
        """

    @activation.setter
    def activation(self, arg: bool, /) -> None: ...

class UnitFootprint:
    """What one unit costs, from its spec and placement."""

    @property
    def device_bytes(self) -> int: ...

    @property
    def home_bytes(self) -> int: ...

    @property
    def swap_in_bytes(self) -> int: ...

    @property
    def write_back_bytes(self) -> int: ...

    @property
    def grad_bytes(self) -> int: ...

    @property
    def reduce_bytes(self) -> int: ...

    @property
    def param_bytes(self) -> int: ...

    @property
    def frozen_device_bytes(self) -> int: ...

def load_config(file: str | os.PathLike, own_tables: Sequence[str] = []) -> Options:
    """
    Reads a TOML configuration; raises ConfigError naming the file, line and key. `own_tables`: top-level tables the trainer reads itself (e.g. [model]), which the loader then ignores.
    """

def parse_config(text: str, source: str = 'config') -> Options:
    """Parses a TOML configuration held in a string."""

def parse_size(text: str) -> int:
    """Parses a size such as "4 MiB" into bytes."""

def policy_for(spec: UnitSpec, options: Options) -> UnitPolicy:
    """
    The policy the runtime gives a unit: its own, else the defaults with matching rules applied.
    """

def footprint(spec: UnitSpec, placement: OptimizerPlacement) -> UnitFootprint:
    """A unit's footprint under a placement."""

def all_pinned_budget(options: Options, units: Sequence[UnitSpec]) -> int:
    """
    The budget that holds every unit pinned (an all-resident baseline), as the runtime packs pinned units.
    """

def step_guard_device_bytes(units: int) -> int:
    """
    The device bytes guarded steps (loss scaling or clipping) take of the budget for this many units, before granule rounding.
    """

class Device:
    """A device: a backend and its index."""

    @property
    def kind(self) -> Backend: ...

    @property
    def index(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def granularity(self) -> int:
        """
        The granule in which the device pool maps memory: a unit takes whole granules of the budget.
        """

    def synchronize(self) -> None:
        """Waits for every stream of the device (tests and tools)."""

    def __eq__(self, arg: Device, /) -> bool: ...

def make_device(options: DeviceOptions) -> Device:
    """The device a configuration's [device] table names."""

def cuda_device_count() -> int:
    """CUDA devices usable by this process (0 without CUDA)."""

class Stream:
    """A stream the runtime created, or a view of another library's."""

    def __init__(self, device: Device, host_synchronous: bool = False) -> None:
        """
        A new stream on `device`. host_synchronous (emulated device only): each operation runs in the calling thread before the call returns (for a trainer computing on the host).
        """

    @property
    def device(self) -> Device: ...

    @property
    def handle(self) -> int: ...

    @property
    def external(self) -> bool: ...

    def synchronize(self) -> None:
        """Blocks until the work queued on the stream is done."""

    def query(self) -> bool: ...

def external_stream(device: Device, handle: int) -> Stream:
    """
    A view of a CUDA stream another library owns (torch.cuda.current_stream().cuda_stream; 0 is the legacy default stream). Raises InvalidArgument on the emulated device.
    """

class Communicator:
    """A communicator the runtime reduces gradients over."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def backend(self) -> CommBackend: ...

def mpi_communicator(device: Device, timeout_s: float = 300.0) -> Communicator:
    """An MPI communicator over MPI_COMM_WORLD (initialises MPI when needed)."""

def nccl_library() -> tuple:
    """
    Loads the NCCL taskswap uses (if not yet loaded) and returns (its file, its version): the file TASKSWAP_NCCL_LIBRARY names, else an NCCL the process has already (torch's), else the one prefer_nccl_library named, else the build's, else libnccl.so.2 on the loader's path.
    """

def prefer_nccl_library(path: str) -> None:
    """
    The NCCL file to try before the build's when the process has none loaded yet (taskswap names the nvidia-nccl wheel's at import).
    """

def nccl_unique_id() -> bytes:
    """A new NCCL unique id (128 bytes), made on one rank and given to all."""

def nccl_communicator(device: Device, unique_id: bytes, rank: int, size: int, timeout_s: float = 300.0) -> Communicator:
    """taskswap's own NCCL communicator (collective over the `size` ranks)."""

def make_communicator(device: Device, options: CommOptions) -> Communicator:
    """The communicator [comm] backend names (None for none)."""

class StepStats:
    """Transfers, hits and stalls of one step (or of all steps)."""

    @property
    def step(self) -> int: ...

    @property
    def h2d_bytes(self) -> int: ...

    @property
    def d2h_bytes(self) -> int: ...

    @property
    def hits(self) -> int: ...

    @property
    def misses(self) -> int: ...

    @property
    def unplanned(self) -> int: ...

    @property
    def frozen(self) -> int: ...

    @property
    def swap_ins(self) -> int: ...

    @property
    def write_backs(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    @property
    def stall_ms(self) -> float: ...

    @property
    def peak_device_bytes(self) -> int: ...

    @property
    def reduced_bytes(self) -> int: ...

    @property
    def reduce_all_bytes(self) -> int: ...

class UnitStats:
    """One unit's residency figures."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> UnitState: ...

    @property
    def dirty(self) -> bool: ...

    @property
    def device_bytes(self) -> int: ...

    @property
    def home_bytes(self) -> int: ...

    @property
    def swap_ins(self) -> int: ...

    @property
    def write_backs(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def policy(self) -> UnitPolicy: ...

class DiskStats:
    """The disk home tier's host cache since the runtime began."""

    @property
    def host_cache_bytes(self) -> int: ...

    @property
    def cached_bytes(self) -> int: ...

    @property
    def hits(self) -> int: ...

    @property
    def misses(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    @property
    def written_back(self) -> int: ...

    @property
    def prefetches(self) -> int: ...

    @property
    def wait_ms(self) -> float: ...

    @property
    def read_bytes(self) -> int: ...

    @property
    def written_bytes(self) -> int: ...

    @property
    def requests(self) -> int: ...

class RuntimeStats:
    """Cumulative figures, the recent steps, and each unit."""

    @property
    def total(self) -> StepStats: ...

    @property
    def steps(self) -> list[StepStats]: ...

    @property
    def units(self) -> list[UnitStats]: ...

    @property
    def budget(self) -> int: ...

    @property
    def pinned_device_bytes(self) -> int: ...

    @property
    def device_bytes_in_use(self) -> int: ...

    @property
    def home_bytes(self) -> int: ...

    @property
    def host_bytes_pinned(self) -> int: ...

    @property
    def device_granule(self) -> int: ...

    @property
    def device_rounding_bytes(self) -> int: ...

    @property
    def disk(self) -> DiskStats: ...

class Runtime:
    """The taskswap runtime (see taskswap::runtime)."""

    def __init__(self, device: Device, options: Options, units: Sequence[UnitSpec], comm: Communicator | None = None) -> None:
        """
        Lays out every unit's home copy, applies the policies, brings pinned units in; with a communicator (`comm`, or None: the one options.comm names, if any), collective.
        """

    @property
    def has_communicator(self) -> bool:
        """Whether gradients are reduced over a communicator (even of one rank)."""

    @property
    def device(self) -> Device: ...

    @property
    def unit_count(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def find(self, name: str) -> int: ...

    def name(self, unit: int) -> str: ...

    def policy(self, unit: int) -> UnitPolicy: ...

    def device_bytes(self, unit: int) -> int: ...

    def state(self, unit: int) -> UnitState: ...

    def tensors(self, unit: int) -> list[tuple[str, list[int], bool]]:
        """The unit's tensors: (name, shape, no_weight_decay)."""

    def plan(self, steps: Sequence[Sequence[tuple[int, int]]]) -> None:
        """
        Appends upcoming steps: each a list of (unit, kind), kind 0 train, 1 frozen, 2 release, 3 stash.
        """

    def acquire(self, unit: int, stream: Stream, frozen: bool = False, stash: bool = False) -> tuple[int, int]:
        """
        Acquires a unit on `stream` (does not synchronise); returns the addresses of its parameter and gradient slabs (0 for a frozen use's gradients). `stash`: an activation block's write.
        """

    def param_tensors(self, unit: int) -> list[torch.Tensor]:
        """
        The held unit's parameters, one tensor per registered tensor (views of the slab).
        """

    def grad_tensors(self, unit: int) -> list[torch.Tensor]:
        """
        The held unit's gradients, one tensor per registered tensor (views of the slab).
        """

    def grads_ready(self, unit: int, stream: Stream) -> None: ...

    def step(self, unit: int, stream: Stream) -> None: ...

    def release(self, unit: int, stream: Stream) -> None: ...

    def skip(self, units: Sequence[int]) -> None:
        """
        The current step will not acquire these units again: their planned acquisitions still ahead in the step are dropped (with a communicator, a use to reduce is completed with zero gradients, in the order given).
        """

    def end_step(self) -> StepStats: ...

    def agree_stop(self, local: int) -> int: ...

    def flush(self) -> None:
        """Writes dirty units back and waits until every home copy is current."""

    def home(self, unit: int, kind: str = 'params') -> list[torch.Tensor]:
        """
        The home copy's tensors (CPU tensors aliasing the pinned arena): kind params, master, m or v. Current after flush() until the unit is next acquired.
        """

    def home_step(self, unit: int) -> int: ...

    def save_checkpoint(self, dir: str | os.PathLike, user: Mapping[str, str] = {}) -> None: ...

    def load_checkpoint(self, dir: str | os.PathLike) -> tuple[int, dict[str, str], int]:
        """
        Restores every unit's home state; returns (steps_done, user entries, world).
        """

    @property
    def optimizer(self) -> AdamW: ...

    @optimizer.setter
    def optimizer(self, arg: AdamW, /) -> None: ...

    def stats(self) -> RuntimeStats: ...

    @property
    def guards_steps(self) -> bool:
        """
        Loss scaling or clipping: the step's units are updated together at end_step.
        """

    def loss_scale_tensor(self) -> torch.Tensor:
        """
        The loss scale in device memory, one float (read it on the step's stream; the runtime changes it at end_step).
        """

    def scaler_state(self) -> LossScalerState:
        """The loss scaler's state, read from the device. Synchronises."""

    def write_trace(self, file: str | os.PathLike) -> None: ...

with_cuda: bool = True

with_nccl: bool = True

with_mpi: bool = True
