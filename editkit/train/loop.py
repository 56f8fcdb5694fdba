"""Fine-tune one task: non-linear, linearized, or either of them + tauJp.

One loop serves every mode. In ``taujp`` mode the unlabeled reg batches are
concatenated to the labelled batch so one jvp call yields both the task's logits
and the penalty's tangents: with BatchNorm frozen the examples do not interact,
and one call of 32 + 4 examples is much cheaper than two calls of 32 and 4.
In ``taujp-nonlinear`` mode the task batch takes the plain forward at theta and
only the reg batches go through a jvp at theta_0.
Batches are collated, concatenated, passed to the module and split by the
backbone's :class:`~editkit.core.batching.Batching` (tensors for images; padded
token ids with an attention mask for sequences), so the loop assumes no modality.

Where it runs is a :class:`~editkit.train.runtime.Runtime`: the device, bf16
autocast on CUDA, DataLoader workers, and under torchrun this process's share of
each global batch (``DistributedDataParallel`` averages the gradients over
processes once per optimizer step; see ``editkit.train.runtime``). A step never reads
a value back to the host: its losses and gradient norm are read one step late
(:class:`LaggedStats`), so a GPU is never left idle waiting for the host.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from editkit.core.batching import Batching, TensorBatching, labelled_collate
from editkit.errors import ConfigError
from editkit.train.runtime import GlobalBatchSampler, Runtime, default_runtime
from editkit.train.timing import StepClock, StepTimes
from editkit.core.linearize import LinearizedModel, build_task_model
from editkit.core.objectives import features_loss
from editkit.train.recipe import Recipe
from editkit.core.curvature import CurvatureRegularizer
from editkit.core.taujp import Regularizer, precompute

#: What a penalized step adds to its loss: the seen tasks' inputs (tauJp) or their banked curvature (data-free).
Penalty = Regularizer | CurvatureRegularizer

log = logging.getLogger(__name__)

TrainStepCallback = Callable[[int, dict[str, float]], None]  # (step, its losses), once the next step has run


@dataclass
class FineTuneResult:
    """The task vector and what it cost: ``seconds`` from the first step to the last, ``times`` split into
    setup, warm-up and steady steps (see :mod:`editkit.train.timing`)."""

    task_vector: dict[str, torch.Tensor]
    seconds: float
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    peak_gpu_bytes: int | None = None
    times: StepTimes = field(default_factory=StepTimes)

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(1, self.steps)


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then cosine decay to 0 (as the official code)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def optimizer_for(params: list[nn.Parameter], recipe: Recipe) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW on theta with the recipe's lr, weight decay and warmup + cosine schedule.

    Fused: one kernel updates every tensor (on the CPU as on CUDA). The default implementation loops
    over the tensors in Python; for EfficientNet-Lite0's 147 tensors that loop took 18 ms a step on
    this 2-core CPU against 7.5 ms fused, the same update to float rounding."""
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay, fused=True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(recipe.warmup_steps, recipe.steps))


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients' global norm to ``max_norm``; returns the norm before clipping (a tensor: reading
    it is a host sync on a GPU, left to whoever displays it). foreach kernels on the CPU too, where torch
    would otherwise loop per tensor (3.7 ms -> 1.5 ms a step for EfficientNet-Lite0)."""
    return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def labelled_batches(
    dataset: Dataset, batch_size: int, seed: int, *, runtime: Runtime | None = None,
    sampler: GlobalBatchSampler | None = None, batching: Batching | None = None,
) -> Iterator[tuple[Any, torch.Tensor]]:
    """Endless seeded shuffled batches of (inputs, labels); extra item fields (task labels) are dropped.

    Epoch ``e`` is the ``e``-th seeded permutation cut into batches of ``batch_size``
    (the last partial batch dropped when there is a full one). Under data parallelism
    each process gets its slice of every such global batch. Inputs are collated by
    ``batching`` (default: stacked tensors).
    """
    runtime = runtime or Runtime()
    sampler = sampler or GlobalBatchSampler(len(dataset), batch_size, seed=seed, rank=runtime.rank,
                                            world_size=runtime.world_size)
    on_device = _held_on_device(dataset, runtime)
    workers = 0 if on_device else runtime.workers
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                        pin_memory=runtime.device.type == "cuda" and not on_device,
                        collate_fn=labelled_collate(batching or TensorBatching()),
                        persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _held_on_device(dataset: Dataset, runtime: Runtime) -> bool:
    """Whether the dataset's inputs already lie on the (non-CPU) device: its batches are then gathered there,
    in this process. Worker processes could not share its tensors, pinning does not apply to them, and
    sending a batch of images through worker processes costs more than the step on a GPU (measured on an
    H200 with ViT-B-32 at batch 128: 57 ms a batch, against a 42 ms plain step)."""
    inputs = getattr(dataset, "inputs", None)
    return isinstance(inputs, torch.Tensor) and inputs.device.type != "cpu" and runtime.device.type != "cpu"


class LaggedStats:
    """Each step's (ce, penalty, grad_norm), read on the host one step late.

    Reading a CUDA tensor (``.item()``) blocks the host until the device has computed it; read
    mid-step it leaves the GPU idle while the host queues the next kernels. Here a step's values
    start their copy to the host when the step has been queued and are read once the next step
    has been queued too, waiting at most for the step they belong to. On a CPU the copy is the
    tensor itself and nothing waits either way; callbacks then see step s after step s + 1 ran.
    """

    KEYS = ("ce", "penalty", "grad_norm")

    def __init__(self) -> None:
        self._pending: tuple[int, torch.Tensor, float, torch.cuda.Event | None] | None = None

    def push(self, step: int, values: torch.Tensor, lr: float) -> list[tuple[int, dict[str, float]]]:
        """Start reading ``step``'s values; returns the previous step's record (now read), if any."""
        ready = self.flush()
        event = None
        host = values.to("cpu", non_blocking=True)  # into pinned memory when values are on a GPU
        if values.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (step, host, lr, event)
        return ready

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        """The pending step's record, if any (after its copy has landed)."""
        if self._pending is None:
            return []
        step, host, lr, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        return [(step, {**dict(zip(self.KEYS, host.tolist())), "lr": lr})]


def reg_batch_stream(regularizer: Penalty | None, steps: int) -> Iterator[list[Any]]:
    """The reg batches of steps 0..steps-1; lazy sources are loaded one step ahead in a thread.

    Draws happen in step order either way, so the batches are the same as drawing in the loop.
    """
    if regularizer is None:
        for _ in range(steps):
            yield []
        return
    if not regularizer.lazy:
        for step in range(steps):
            yield regularizer.batches(step)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="editkit-reg") as pool:
        pending = pool.submit(regularizer.batches, 0) if steps > 0 else None
        for step in range(steps):
            current = pending.result()
            pending = pool.submit(regularizer.batches, step + 1) if step + 1 < steps else None
            yield current


def planned_indices(sampler: GlobalBatchSampler, batches: int) -> list[int]:
    """This process's example indices in the first ``batches`` batches ``sampler`` yields, epoch after epoch
    (read from its seeded permutations, which drawing them again later reproduces)."""
    index: list[int] = []
    epoch = 0
    while batches > 0:
        for batch in sampler.global_batches(epoch)[:batches]:
            index += sampler.shard(batch)
            batches -= 1
        epoch += 1
    return index


def encode_ahead(train: Dataset, sampler: GlobalBatchSampler, recipe: Recipe, regularizer: Penalty | None) -> None:
    """Before the first step, let the task data and the reg sources encode what the run's steps will read
    (:func:`~editkit.core.taujp.precompute`: a text's frozen-prefix states). Encoding is then setup, paid
    once and apart from the steps, whatever mode runs first over a shared dataset; the steps read what
    they would have computed, so every number is unchanged."""
    precompute(train, planned_indices(sampler, recipe.steps * recipe.accumulation))
    if regularizer is not None:
        regularizer.prepare(recipe.steps)


class StepComputer:
    """Forward pass and loss of one micro-batch for a given mode.

    batching: how the backbone's inputs are concatenated, passed and split
        (default: tensors, as for images).
    """

    def __init__(self, model: nn.Module, head: nn.Module, regularizer: Penalty | None,
                 batching: Batching | None = None) -> None:
        self.model = model
        self.head = head
        self.regularizer = regularizer if regularizer is not None and regularizer.active else None
        self.batching = batching or TensorBatching()
        self.task_loss = features_loss(head)

    def loss(
        self, x: Any, y: torch.Tensor, reg_batches: list[Any], penalize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """(task loss, lambda * penalty or None, stats) for one micro-batch (``penalize``: whether the penalty
        counts in it: a step's first micro-batch).

        The task loss is the head's (:func:`~editkit.core.objectives.features_loss`): cross-entropy
        for classifiers, next-token loss over real positions for a language model's head.
        stats: ``ce`` and ``penalty`` (without lambda), detached 0-d tensors left on the device:
        reading them here would make the host wait for the forward before it queues the backward."""
        features, reg = self.features(x, reg_batches, penalize)
        ce = self.task_loss(features.float(), y)  # float(): no-op in fp32; leaves bf16
        penalty = reg.detach() / self.regularizer.lam if reg is not None else torch.zeros_like(ce)
        return ce, reg, {"ce": ce.detach(), "penalty": penalty}

    def features(self, x: Any, reg_batches: list[Any], penalize: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the task model's features of ``x``, lambda * penalty on ``reg_batches`` or None).

        A penalty that reads no input (the seen tasks' curvature) is a function of the vector alone: added where
        ``penalize``, beside the model's own forward.

        The penalty's tangents come from one jvp at theta_0 along the vector this task adds: for the linearized
        model the same jvp as the task batch's forward (the reg batches ride along in it), unless it is
        fine-tuned beside earlier vectors (``from_sum``: its forward moves along their sum too, the penalty along
        what it adds alone); for the plain model (``taujp-nonlinear``) a jvp of the reg batches alone, the task
        batch taking the ordinary forward at theta. Apart from :meth:`loss` so that a training loop which applies
        the head and the task loss itself (an Avalanche strategy) runs the same forward as this loop."""
        if self.regularizer is None or not penalize:
            return self._forward(x), None
        if not self.regularizer.needs_inputs:
            return self._forward(x), self.regularizer.loss_of(self.model.live_vector())
        if not reg_batches:
            return self._forward(x), None
        if isinstance(self.model, LinearizedModel) and self.model.beside is None:
            primals, tangents, masks = self._jvp([x, *reg_batches])
            return primals[0] + tangents[0], self._penalty(primals[1:], tangents[1:], masks[1:])
        primals, tangents, masks = self._jvp(reg_batches)
        return self._forward(x), self._penalty(primals, tangents, masks)

    def _forward(self, x: Any) -> torch.Tensor:
        """The task model's own forward: f(x; theta), or f_lin(x; theta) (a jvp of its own)."""
        return self.batching.run(self.model, x)

    def _jvp(self, batches: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
        """jvps at theta_0 over ``batches``: per batch, f(x; theta_0), J_theta0 f(x) . tau (tau what this task
        adds) and which output positions are real (None: all). The batches are concatenated (with BatchNorm
        frozen, examples do not interact) and run through the backbone's batching, which may group rows of
        similar lengths."""
        batching = self.batching
        batch = batching.concat(batches[0], batches[1:])
        primal, tangent = batching.run(self.model.primal_and_added, batch)
        sizes = [len(b) for b in batches]
        mask = batching.output_mask(batch)
        masks = batching.split(mask, sizes) if mask is not None else [None] * len(batches)
        return batching.split(primal, sizes), batching.split(tangent, sizes), masks

    def _penalty(self, primals: list[torch.Tensor], tangents: list[torch.Tensor],
                 masks: list[torch.Tensor | None]) -> torch.Tensor:
        """lambda * penalty of the reg batches' tangents (through the fixed head first when it measures logits;
        the distribution measure also reads theta_0's logits, the head's image of the primals)."""
        if not self.regularizer.on_logits:
            return self.regularizer.loss([t.float() for t in tangents], masks)
        # The fixed head is linear: the logits' tangents are the head's image of the features' tangents.
        logits = [self.head(p).float() for p in primals] if self.regularizer.measure == "distribution" else None
        return self.regularizer.loss([self.head(t).float() for t in tangents], masks, logits)


class SyncedStep(nn.Module):
    """One micro-batch's :meth:`StepComputer.loss` as a module, for ``DistributedDataParallel`` to wrap.

    DDP reduces the gradients of what runs inside its own ``forward``, and the tauJp step calls
    ``primal_and_tangent`` rather than the task model's ``forward``; so DDP wraps the whole step.
    It holds theta, the only trainable parameters (theta_0 and the head are frozen), so theta is
    what DDP reduces.
    """

    def __init__(self, computer: StepComputer) -> None:
        super().__init__()
        self.computer = computer
        self.theta = computer.model.theta

    def forward(
        self, x: Any, y: torch.Tensor, reg_batches: list[Any], penalize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        return self.computer.loss(x, y, reg_batches, penalize)


def fine_tune(
    module: nn.Module,
    head: nn.Module,
    train: Dataset,
    recipe: Recipe,
    regularizer: Penalty | None = None,
    *,
    on_step: TrainStepCallback | None = None,
    runtime: Runtime | None = None,
    batching: Batching | None = None,
    start: Mapping[str, torch.Tensor] | None = None,
    beside: Mapping[str, torch.Tensor] | None = None,
    time_parts: bool = False,
) -> FineTuneResult:
    """Fine-tune ``module`` (theta_0, left untouched) on ``train`` with ``head`` fixed.

    Returns tau = theta_ft - theta_0 over the module's parameters (on the CPU), wherever
    training started: at theta_0, or at theta_0 + ``start`` (a task vector: the previous
    experience's in ``sequential`` mode, which keeps training one model task after task). With
    ``beside`` (``from_sum``: the sum of the vectors banked before) training starts at theta_0 + beside
    and tau is what it adds to them, theta_ft - theta_0 - beside, which the penalty reads too. The
    regularizer is used only in the penalized modes (``taujp``, ``taujp-nonlinear``).
    The module's values never change, but it is switched to eval mode with gradients
    off (it is theta_0, shared by every task model).

    runtime: device, precision, workers and process group (default: one process on
        the module's device, fp32). ``recipe.batch_size`` is the *global* micro-batch
        (less the reg rows with ``reg_within_batch``, :meth:`Recipe.labelled_rows`):
        with N processes each computes on its ~batch_size / N slice, and the
        regularizer should carry ``shard=(rank, N)``.
    batching: the backbone's :class:`~editkit.core.batching.Batching` (default: tensors,
        as for images); the regularizer's sources must yield batches of the same kind.
    on_step: called with each step's index and its ``ce``, ``penalty``, ``grad_norm`` and ``lr``,
        in order, once the next step has run (the last at the end; see :class:`LaggedStats`).
    time_parts: also time each part of every step (:data:`~editkit.train.timing.PARTS`) into the result's
        ``times.parts``; on a GPU this synchronizes the device between parts, so it is for profiling only.
    """
    runtime = runtime or default_runtime(module)
    clock = StepClock(parts=time_parts, device=runtime.device)
    torch.manual_seed(recipe.seed)
    model = runtime.place(build_task_model(module, recipe.mode))
    if start is not None or beside is not None:
        model.load_task_vector(start or {}, beside=beside)
    head.to(runtime.device).eval().requires_grad_(False)
    computer = StepComputer(model, head, regularizer if recipe.mode.penalized else None, batching)
    step_loss = runtime.data_parallel(SyncedStep(computer))
    params = list(model.theta)
    optimizer, schedule = optimizer_for(params, recipe)
    rows = recipe.labelled_rows(computer.regularizer)
    sampler = GlobalBatchSampler(len(train), rows, seed=recipe.seed, rank=runtime.rank, world_size=runtime.world_size)
    ce_weight = sampler.shard_fraction  # 1.0 unless processes hold unequal slices
    batches = labelled_batches(train, rows, recipe.seed, runtime=runtime, sampler=sampler, batching=computer.batching)
    encode_ahead(train, sampler, recipe, computer.regularizer)
    reg_stream = reg_batch_stream(computer.regularizer, recipe.steps)
    device, non_blocking = runtime.device, runtime.device.type == "cuda"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    history: list[dict[str, float]] = []

    def report(records: list[tuple[int, dict[str, float]]]) -> None:
        for step, record in records:
            history.append(record)
            if on_step is not None:
                on_step(step, record)

    stats = LaggedStats()
    clock.begin_steps()
    began = time.perf_counter()
    for step in range(recipe.steps):
        optimizer.zero_grad(set_to_none=True)
        reg_batches = [b.to(device, non_blocking=non_blocking) for b in next(reg_stream)]
        clock.lap("reg_batch")
        totals = _accumulate_gradients(step_loss, batches, reg_batches, recipe.accumulation, ce_weight, runtime,
                                       clock)
        grad_norm = _clipped_gradients(model, params, totals, recipe.grad_clip, runtime)
        lr = schedule.get_last_lr()[0]
        optimizer.step()
        schedule.step()
        clock.lap("optimizer")
        report(stats.push(step, torch.cat([totals, grad_norm.detach().float().reshape(1)]), lr))
        clock.end_step()
    report(stats.flush())
    peak = _peak_memory(device)
    seconds = time.perf_counter() - began
    reg_stream.close()
    log.info("fine-tuned %d steps in %.1fs (%s, %s)", recipe.steps, seconds, recipe.mode, runtime.describe())
    tau = {name: value.cpu().contiguous() for name, value in model.task_vector().items()}  # whatever the layout
    return FineTuneResult(tau, seconds, recipe.steps, history, peak, clock.times)


def _clipped_gradients(model: nn.Module, params: list[nn.Parameter], totals: torch.Tensor, max_norm: float,
                       runtime: Runtime) -> torch.Tensor:
    """Clip the step's gradients in place and return their norm before clipping. Under data parallelism every
    parameter must have one (DDP reduces them all; a missing one is refused by name), and ``totals`` (display
    only) is averaged over the processes in place."""
    grads = [p for p in params if p.grad is not None]
    if runtime.distributed:
        if len(grads) < len(params):
            raise ConfigError(_unused_parameters_message(model, params))
        runtime.all_reduce_sum(totals).div_(runtime.world_size)  # in place, like the reduction
    return clip_gradients(grads, max_norm)


def _peak_memory(device: torch.device) -> int | None:
    """The device's peak allocated bytes since the run reset them (CUDA; None elsewhere, where the benchmarks
    sample the process's RSS instead)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def _accumulate_gradients(step_loss: nn.Module, batches: Iterator[tuple[Any, torch.Tensor]], reg_batches: list[Any],
                          accumulation: int, ce_weight: float, runtime: Runtime, clock: StepClock) -> torch.Tensor:
    """Forward and backward of one optimizer step's micro-batches; returns its (ce, penalty) on the device.

    CE is averaged over the micro-batches (scaled by ``ce_weight`` where processes hold unequal
    slices); the reg batches ride with the first micro-batch, so the penalty counts once, at full
    weight. Under DDP only the last micro-batch's backward reduces the gradients."""
    device, non_blocking = runtime.device, runtime.device.type == "cuda"
    totals = torch.zeros(2, device=device)
    for micro in range(accumulation):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
        clock.lap("task_batch")
        with runtime.gradient_sync(step_loss, sync=micro == accumulation - 1):
            with runtime.autocast():
                ce, reg, stats = step_loss(x, y, reg_batches if micro == 0 else [], micro == 0)
            if ce_weight != 1.0:
                ce = ce * ce_weight
            clock.lap("forward")
            (ce / accumulation + (reg if reg is not None else 0.0)).backward()
            clock.lap("backward")
        totals += torch.stack([stats["ce"].float() / accumulation, stats["penalty"].float()])
    return totals


def _unused_parameters_message(model: nn.Module, params: list[nn.Parameter]) -> str:
    unused = [name for name, p in zip(model.names, params) if p.grad is None]
    return (
        f"{len(unused)} backbone parameters never reach the features ({', '.join(unused[:5])}"
        f"{', ...' if len(unused) > 5 else ''}): data-parallel training needs every parameter of the backbone's "
        "module to be used; build the backbone without them"
    )


