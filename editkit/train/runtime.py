"""Where training runs: device, precision, and data-parallel processes (torchrun).

``Runtime`` is what the trainer, the evaluator and the stream runner need to know
about the machine: the device, whether to autocast to bf16, how many DataLoader
workers to use, and, under ``torchrun``, this process's rank in the group.

Data parallelism: ``DistributedDataParallel`` over the step
-----------------------------------------------------------
Every process holds the whole task model and computes its gradient on its share
of each *global* batch; :meth:`Runtime.data_parallel` wraps the training step in
``torch.nn.parallel.DistributedDataParallel``, which averages the gradients of
theta over the processes (bucketed, overlapping the backward pass) once per
optimizer step, and every process applies the same clipped AdamW step:

- DDP reduces the gradients of what runs inside its own ``forward``. The tauJp
  step calls ``LinearizedModel.primal_and_tangent`` (one jvp over the labelled and
  the unlabeled batch), not the task model's ``forward``, so DDP wraps the whole
  step (see ``editkit.train.loop``), not the task model.
- Under gradient accumulation all micro-batches but the last run in
  :meth:`Runtime.gradient_sync`'s ``no_sync``: one reduction per optimizer step.
- Every parameter of theta must reach the features. DDP without
  ``find_unused_parameters`` (which costs a walk of the autograd graph every step)
  would not reduce the gradients of a step in which one gets none, and fail only at
  the next step; the loop refuses such a backbone after its first backward instead
  (a parameter that never moves only adds zeros to every banked vector).
- No buffer is synchronised: the wrapped step holds theta alone; the buffers
  (BatchNorm statistics) belong to theta_0, frozen and identical everywhere.

Batches are sharded so that any number of processes sees exactly the batches of
one process: :class:`GlobalBatchSampler` draws the single-process global batch
(the same seeded permutation per epoch, re-drawn at :meth:`~GlobalBatchSampler.set_epoch`)
and hands each rank a contiguous slice of it. ``torch.utils.data.DistributedSampler``
would shuffle with ``seed + epoch`` and stride indices across ranks, so a 2-GPU run
would train on different batches than a 1-GPU run; here the bank a run writes does
not depend on the number of GPUs (up to float summation order).

Only rank 0 writes the bank and reports; the others wait at :meth:`Runtime.barrier`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Sampler

from editkit.errors import ConfigError
from editkit.settings import torchrun_world
from editkit.util.memory import keep_freed_memory
from editkit.util.sharding import shard_bounds

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp32")
#: Collective timeout: rank 0 may evaluate or write a bank while the others wait.
TIMEOUT = datetime.timedelta(hours=2)


def resolve_device(device: str | torch.device | None = None, *, local_rank: int = 0) -> torch.device:
    """``None`` / ``"auto"``: CUDA (this process's local GPU) when available, else CPU."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device} was asked for but CUDA is not available (torch {torch.__version__})")
        if resolved.index is None:
            resolved = torch.device("cuda", local_rank % torch.cuda.device_count())
    return resolved


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively on ``device``: on CUDA, and on a CPU with AVX512-BF16 or AMX.
    Elsewhere oneDNN emulates them, and they are slower than fp32 ones: on an AVX2-only 2-core EPYC a reduced
    ``editkit negate toxic`` (2 steps, 8 samples) took 617 s in bf16 against 142 s in fp32."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_precision(precision: str | None, device: torch.device, preferred: str | None = None) -> str:
    """``auto``: the scenario's ``preferred`` precision when it names one, else bf16 autocast on CUDA and fp32
    elsewhere. A scenario names one where its numbers were measured in it (``toxic``: bf16, whose matrix products
    a CPU with AVX512-BF16 or AMX runs several times faster), so its documented numbers are what ``auto``
    reproduces; a preferred bf16 becomes fp32 where bf16 would be emulated (:func:`native_bf16`), with a
    warning. A precision the user names is taken as given."""
    precision = precision or "auto"
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    if preferred == "bf16" and not native_bf16(device):
        log.warning("the scenario runs in bf16, but this %s has no native bf16 (neither AVX512-BF16 nor AMX), where "
                    "it is slower than fp32: running fp32 (--precision bf16 forces bf16)", device.type.upper())
        return "fp32"
    return preferred or ("bf16" if device.type == "cuda" else "fp32")


@dataclass(frozen=True)
class RuntimeOptions:
    """What a user chooses about the runtime (every command that computes takes these);
    :func:`setup` resolves them into a :class:`Runtime` for this process.

    Each field's ``metadata["help"]`` is its one description (the CLI's options are generated from it).
    """

    device: str | None = field(default=None, metadata={
        "help": "cpu | cuda | cuda:N (default: CUDA when available; under torchrun the local rank's GPU)."})
    precision: str | None = field(default=None, metadata={
        "help": "auto | bf16 | fp32 (auto: the scenario's own precision if it names one, else bf16 autocast on "
                "CUDA and fp32 on a CPU)."})
    workers: int | None = field(default=None, metadata={
        "help": "DataLoader workers per process (default: 0 on CPU, up to 8 on GPU)."})
    channels_last: bool = field(default=False, metadata={
        "help": "Hold the backbone's 4-D weights channels-last (NHWC): a convolutional backbone's steps run "
                "faster in every mode on a CPU; results change at float rounding (off: the numbers as documented)."})


@dataclass(frozen=True)
class Runtime:
    """Device, precision, loader workers and this process's place in the process group.

    rank / world_size: this process and the number of data-parallel processes (1: none).
    precision: ``bf16`` runs forward passes under ``torch.autocast(dtype=bfloat16)``
        (parameters, gradients and optimizer state stay fp32); ``fp32`` does not.
    workers: DataLoader worker processes for labelled batches and evaluation.
    channels_last: :meth:`place` lays 4-D weights out channels-last. Convolutions then pick
        NHWC kernels whatever the inputs' layout (on a CPU, oneDNN's depthwise and pointwise
        kernels are faster in it), so only the modules are converted, never the batches.
    """

    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    workers: int = 0
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    channels_last: bool = False

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp32"):
            raise ConfigError(f"precision must be bf16 or fp32 once resolved, got {self.precision!r}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        where = f"{self.device}" + (f" x {self.world_size} processes" if self.distributed else "")
        return f"{where}, {self.precision}" + (", channels-last" if self.channels_last else "")

    def place(self, module: nn.Module) -> nn.Module:
        """``module`` moved to the device (in place, as ``nn.Module.to``), channels-last when asked for."""
        if self.channels_last:
            return module.to(self.device, memory_format=torch.channels_last)
        return module.to(self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- collectives (no-ops in a single process) ---------------------------------------------
    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()

    def data_parallel(self, step: nn.Module) -> nn.Module:
        """``step`` wrapped in ``DistributedDataParallel`` (``step`` itself in a single process).

        ``step``'s trainable parameters must have the same shapes, in the same order, on every
        process; DDP copies rank 0's values to the others once, here. ``forward_sync_buffers``
        is torch's name for the deprecated ``broadcast_buffers``.
        """
        if not self.distributed:
            return step
        return DistributedDataParallel(
            step, device_ids=[self.device] if self.device.type == "cuda" else None, forward_sync_buffers=False
        )

    def gradient_sync(self, step: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward: ``sync=False`` keeps its gradients local
        (DDP's ``no_sync``), so gradient accumulation reduces once, on the last micro-batch."""
        if sync or not isinstance(step, DistributedDataParallel):
            return contextlib.nullcontext()
        return step.no_sync()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        return tensor

    def all_gather_object(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def shard_bounds(self, size: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous share of ``size`` items (earlier ranks get the remainder)."""
        return shard_bounds(size, self.rank, self.world_size)


def setup(
    device: str | torch.device | None = None,
    precision: str | None = "auto",
    workers: int | None = None,
    channels_last: bool = False,
    preferred_precision: str | None = None,
) -> Runtime:
    """The runtime of this process; under torchrun, joins the process group (NCCL on CUDA, gloo on CPU).

    On a CPU, glibc's allocator is told to keep freed memory (``keep_freed_memory``): a
    language-model step then spends far less time in page faults.

    workers: ``None`` = 0 on CPU, else ``min(8, cpus per process)``.
    preferred_precision: what ``auto`` precision resolves to (:func:`resolve_precision`): the scenario's own.
    """
    rank, world, local = torchrun_world()
    resolved = resolve_device(device, local_rank=local)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if resolved.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {"backend": backend, "timeout": TIMEOUT}
            if backend == "nccl":
                kwargs["device_id"] = resolved
            dist.init_process_group(**kwargs)
            log.info("rank %d/%d joined a %s process group on %s", rank, world, backend, resolved)
        rank, world = dist.get_rank(), dist.get_world_size()
    if resolved.type == "cpu":
        keep_freed_memory()
    if workers is None:
        workers = 0 if resolved.type == "cpu" else min(8, max(1, (os.cpu_count() or 1) // max(1, world)))
    if workers < 0:
        raise ConfigError(f"workers must be >= 0, got {workers}")
    return Runtime(resolved, resolve_precision(precision, resolved, preferred_precision), workers, rank, world, local,
                   channels_last=channels_last)


def teardown() -> None:
    """Leave the process group if this process joined one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def default_runtime(module: torch.nn.Module | None = None, precision: str | None = None) -> Runtime:
    """Single process on the module's device, no workers (the library's default); fp32 unless ``precision`` (a
    scenario's own) says otherwise."""
    device = torch.device("cpu")
    if module is not None:
        first = next(iter(module.parameters()), None)
        if first is not None:
            device = first.device
    return Runtime(device=device, precision=precision or "fp32")


#: ``RandomSampler.__iter__`` draws a second (empty-sliced) ``randperm`` at the end of
#: every pass, so a pass advances its generator by two permutations.
DRAWS_PER_EPOCH = 2


class GlobalBatchSampler(Sampler[list[int]]):
    """Batch sampler: this rank's contiguous slice of each single-process global batch.

    Epoch ``e`` shuffles as pass ``e`` of ``RandomSampler(generator=Generator().manual_seed(seed))``
    does (the single-process loader editkit always used), cut into global batches of ``batch_size`` (the last
    partial one dropped when there is at least one full batch). Call
    :meth:`set_epoch` before iterating each epoch, as with ``DistributedSampler``.
    Use as ``DataLoader(dataset, batch_sampler=...)``.
    """

    def __init__(self, size: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if size < 1:
            raise ConfigError("cannot sample batches from an empty dataset")
        self.size = size
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = size >= batch_size
        self.global_batch = min(batch_size, size)
        if self.global_batch < world_size:
            raise ConfigError(
                f"a global batch of {self.global_batch} examples cannot be split over {world_size} processes"
            )
        self.epoch = 0
        self._states = [torch.Generator().manual_seed(seed).get_state()]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator()
        while len(self._states) <= epoch:  # replay earlier epochs' draws once
            generator.set_state(self._states[-1])
            for _ in range(DRAWS_PER_EPOCH):
                torch.randperm(self.size, generator=generator)
            self._states.append(generator.get_state())
        generator.set_state(self._states[epoch])
        return torch.randperm(self.size, generator=generator).tolist()

    def global_batches(self, epoch: int) -> list[list[int]]:
        order = self.permutation(epoch)
        stop = (self.size // self.batch_size) * self.batch_size if self.drop_last else self.size
        return [order[i : i + self.batch_size] for i in range(0, stop, self.batch_size)]

    def shard(self, batch: list[int]) -> list[int]:
        start, stop = shard_bounds(len(batch), self.rank, self.world_size)
        return batch[start:stop]

    @property
    def shard_fraction(self) -> float:
        """This rank's share of a global batch, times the world size (1.0 when shares are equal)."""
        start, stop = shard_bounds(self.global_batch, self.rank, self.world_size)
        return (stop - start) * self.world_size / self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches(self.epoch):
            yield self.shard(batch)

    def __len__(self) -> int:
        return self.size // self.batch_size if self.drop_last else 1
