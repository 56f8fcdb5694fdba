"""The fine-tuning recipe: every knob of one task's training, in one dataclass.

Scenario files give a recipe; the CLI and the Python API override single fields.
Defaults are the offline-vision values except the penalty's rows, which default to the paper's cyclic
schedule beside the batch (offline-vision's file asks for 8 mixed rows within it); the vision8 scenario
sets the paper's.

Length of training: ``steps`` optimizer steps, or, when ``epochs`` is set, as many
steps as that many passes over the task's train split take
(``ceil(epochs * ceil(train_size / (labelled rows * accumulation)))``, see
:meth:`Recipe.resolved`; the labelled rows are the batch less the reg rows ``reg_within_batch``
takes into it). A mapping (scenario table, per-task option, CLI overrides) that gives ``steps``
without ``epochs`` means steps: it clears an ``epochs`` inherited from a lower level, so
``--steps 5`` overrides per-task epochs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from editkit.core.adapters import ADAPTERS, LoraSpec, attach_lora
from editkit.core.modes import Mode
from editkit.errors import ConfigError, check_choices
from editkit.util.fields import choice

if TYPE_CHECKING:  # the penalty runs on torch; the recipe is read by commands that need none (editkit --help)
    from torch import nn

    from editkit.core.curvature import Curvature, CurvatureRegularizer
    from editkit.core.taujp import Regularizer, Shard, UnlabeledSource

SCHEDULES = ("cyclic", "strict", "mixed")  # as editkit.core.taujp.ROWS_PER_SOURCE implements them
SCOPES = ("seen", "all")
PENALTY_TARGETS = ("features", "logits", "distribution")
PENALTIES = ("inputs", "kfac")
CURVATURE_COMBINES = ("sum", "apart")  # as editkit.core.curvature.COMBINES implements them
CURVATURE_PRECISIONS = ("fp32", "bf16")  # as editkit.core.curvature.PRECISIONS implements them
#: Fields of the data-free penalty alone: recorded only where ``penalty = "kfac"``.
CURVATURE_FIELDS = ("curvature_examples", "curvature_combine", "curvature_energy", "curvature_precision")
#: Fields only the tauJp penalty reads: a mode without the penalty trains the same vector whatever they are.
PENALTY_FIELDS = ("lam", "schedule", "scope", "reg_batch", "reg_within_batch", "squared", "penalty_on", "generic",
                  "penalty", *CURVATURE_FIELDS)
#: Fields that say which vector editkit's modes train (the mode, where it starts, its penalty), not how the network
#: is optimized: a continual-learning strategy, training the plain network, reads none of them (nor the adapter's).
VECTOR_FIELDS = ("mode", "from_sum", *PENALTY_FIELDS)


@dataclass(frozen=True)
class Recipe:
    """How one task is fine-tuned.

    Each field's ``metadata["help"]`` is its one description: the CLI's options are
    generated from it (``metadata["choices"]``: the allowed values of a text field).
    """

    mode: Mode = choice(Mode.TAUJP, tuple(m.value for m in Mode),
                        "taujp: linearized fine-tuning plus the tauJp penalty on unlabeled inputs of other tasks; "
                        "linear: linearized fine-tuning; nonlinear: plain fine-tuning; taujp-nonlinear: plain "
                        "fine-tuning plus the tauJp penalty, computed by a jvp at theta_0 on the unlabeled batch "
                        "only (its vectors merge with nonlinear ones); sequential: plain fine-tuning from the "
                        "previous task's weights, merged by MagMax in the stream (MagMax's continual recipe).")
    steps: int = field(default=100, metadata={
        "help": "Optimizer steps per task (given without epochs, it replaces epochs set at a lower level)."})
    batch_size: int = field(default=32, metadata={
        "help": "Examples per micro-batch, for all processes together (split over torchrun processes)."})
    lr: float = field(default=1e-4, metadata={"help": "Peak learning rate (AdamW)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    warmup: float = field(default=0.1, metadata={
        "help": "Warmup: a fraction of the steps if < 1, else a number of steps; cosine decay after."})
    grad_clip: float = field(default=1.0, metadata={"help": "Gradient-norm clip."})
    accumulation: int = field(default=1, metadata={
        "help": "Micro-batches per optimizer step (examples per step = batch size x accumulation)."})
    lam: float = field(default=0.1, metadata={"help": "tauJp weight lambda."})
    schedule: str = choice("cyclic", SCHEDULES,
                           "tauJp schedule: cyclic draws one batch from one penalty source per step, in turn; "
                           "strict draws one batch from every source and averages their penalties; mixed spreads "
                           "one batch's rows over every source in turn and averages their penalties.")
    scope: str = choice("seen", SCOPES, "Penalty sources: seen = the tasks earlier in the stream (incremental); "
                        "all = every other task of the scenario (joint).")
    reg_batch: int | None = field(default=None, metadata={
        "help": "Unlabeled examples per penalty source per step (unset: batch size // 8, at least 1)."})
    reg_within_batch: bool | int = field(default=False, metadata={
        "help": "How many of a step's reg rows are part of the batch, each in a labelled row's place: true = all "
                "of them (a penalized micro-batch holds batch size less the reg rows a step draws of labelled "
                "examples, so a tauJp step carries the rows a step without the penalty does and costs about what it "
                "costs: a row's cost is its forward, jvp and backward, labelled or not); false = none (they ride "
                "beside a full batch); a count N (in a scenario file or the Python API) = N of them, at most the "
                "rows a step draws, the rest beside. An epoch is still a pass over the labelled examples, so it "
                "takes more steps; not with accumulation > 1."})
    squared: bool = field(default=False, metadata={
        "help": "Penalise ||J tau||^2 instead of ||J tau|| (the official code uses the norm)."})
    penalty_on: str = choice("features", PENALTY_TARGETS,
                             "What tauJp measures: features = the backbone's outputs (a language model's final "
                             "hidden states, per sequence, padding masked); logits = a language model's next-token "
                             "logits (the head applied to the tangent), L2 over the sequence axis and averaged over "
                             "the vocabulary, as in the paper's text code; distribution = the tangent of a language "
                             "model's next-token log-probabilities, each token weighted by theta_0's probability of "
                             "it (twice the second-order KL of the distribution it samples from).")
    penalty: str = choice("inputs", PENALTIES,
                          "What the tauJp penalty reads of the tasks seen so far: inputs = their unlabeled inputs, "
                          "drawn every step (the paper's penalty); kfac = their curvature at theta_0 (Kronecker "
                          "factors computed once on each task's own training inputs and banked beside its vector), "
                          "so no earlier input is kept or drawn: ||J tau||^2 on their inputs as a quadratic form "
                          "in tau (TAK, ICLR 2026). With kfac, schedule, reg_batch and reg_within_batch do not apply.")
    curvature_examples: int = field(default=256, metadata={
        "help": "kfac: training inputs of a task its curvature is computed on (one Gaussian probe each). More see "
                "more of each factor's directions (a layer with few positions needs many examples to reach its "
                "rank): the curvature's time grows with them and its bytes with the rank it reaches."})
    curvature_combine: str = choice("sum", CURVATURE_COMBINES,
                                    "kfac: how the seen tasks' curvatures penalise a vector: sum = one factor set, "
                                    "their mean (constant cost however many tasks); apart = each task's own, their "
                                    "penalties averaged (cost grows with the tasks).")
    curvature_energy: float = field(default=1.0, metadata={
        "help": "kfac: share of each Kronecker factor's trace kept (its largest eigenvectors); 1 keeps every "
                "eigenvector above numerical zero, less is cheaper and approximate."})
    curvature_precision: str = choice("fp32", CURVATURE_PRECISIONS,
                                      "kfac: the dtype a step multiplies the factors in: bf16 holds them in "
                                      "bfloat16 (products accumulate in fp32), 2.5-3.7x faster products where bf16 "
                                      "is native (a CPU with AVX512-BF16 or AMX, a GPU) at about 1e-3 of the form's "
                                      "value; the banked factors stay fp32. A bf16 run's autocast multiplies them "
                                      "in bf16 either way.")
    generic: bool = field(default=True, metadata={
        "help": "Also penalise on the scenario's always-available unlabeled source, if it has one: it "
                "regularises the first task of a stream, which has no earlier task."})
    from_sum: bool = field(default=False, metadata={
        "help": "Start each task at theta_0 plus the sum of the vectors banked before it in the stream, and bank what "
                "it adds to them: the task is fitted to what the earlier vectors already do to its inputs, so their "
                "sum at alpha = 1 is the model trained last, and the tauJp penalty reads the added vector alone. A "
                "vector is then its task's beside the earlier ones, not alone. Not with sequential (which starts "
                "from the previous weights) nor with a LoRA adapter in a plain mode (its vectors do not add)."})
    seed: int = field(default=0, metadata={"help": "Random seed."})
    epochs: float | None = field(default=None, metadata={
        "help": "Epochs per task (passes over its labelled examples), turned into steps from each train split's "
                "size (replaces steps set at any level; unset: steps as given)."})
    adapter: str = choice("none", ADAPTERS,
                          "none: the vector covers every trainable parameter; lora: a LoRA adapter (PEFT) on the "
                          "target layers is trained instead, in every mode (linear / taujp: L-LoRA, the model "
                          "linearized in the adapter's parameters); vectors of a few MB.")
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha: the update is (alpha / r) B A."})
    lora_dropout: float = field(default=0.0, metadata={
        "help": "Dropout on a LoRA adapter's input during plain (nonlinear) training."})
    lora_targets: tuple[str, ...] = field(default=(), metadata={
        "help": "Layers LoRA adapts, as PEFT's target_modules name them (e.g. q_proj,v_proj); unset: every "
                "linear layer and ungrouped convolution of the trainable module."})
    lora_rslora: bool = field(default=False, metadata={
        "help": "Rank-stabilized LoRA scaling, alpha / sqrt(r)."})
    lora_lr: float | None = field(default=None, metadata={
        "help": "Peak learning rate of adapter runs, in place of lr (LoRA factors want a step 10-100x a full "
                "fine-tune's; the shipped scenarios set theirs); unset: lr."})

    def __post_init__(self) -> None:
        check_choices(self, "recipe")
        object.__setattr__(self, "mode", Mode(self.mode))  # frozen; a str enum, so to_dict() keeps the string
        for name in ("steps", "batch_size", "accumulation"):
            if getattr(self, name) < 1:
                raise ConfigError(f"recipe.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.lam < 0 or self.warmup < 0:
            raise ConfigError("recipe: lr must be > 0, lam and warmup >= 0")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"recipe.epochs must be > 0 (or unset), got {self.epochs}")
        if self.lora_lr is not None and not self.lora_lr > 0:
            raise ConfigError(f"recipe.lora_lr must be > 0 (or unset), got {self.lora_lr}")
        if self.curvature_examples < 1 or not 0 < self.curvature_energy <= 1:
            raise ConfigError("recipe: curvature_examples must be >= 1 and curvature_energy in (0, 1], got "
                              f"{self.curvature_examples} and {self.curvature_energy}")
        if self.reg_batch is not None and self.reg_batch < 1:
            raise ConfigError(f"recipe.reg_batch must be >= 1 (or unset), got {self.reg_batch}")
        within = self.reg_within_batch
        if not isinstance(within, (bool, int)) or within < 0:
            raise ConfigError(f"recipe.reg_within_batch must be true, false or a count of reg rows >= 0, got {within!r}")
        if within == 0:
            object.__setattr__(self, "reg_within_batch", False)  # none within: the rows ride beside, as with false
        if self.regularized and self.reg_within_batch and self.accumulation > 1:
            # The reg rows ride with a step's first micro-batch only: the later ones would be short of rows with
            # nothing in their place.
            raise ConfigError(
                f"recipe.reg_within_batch: the reg rows ride with the first of a step's {self.accumulation} "
                f"micro-batches only; set accumulation = 1 or reg_within_batch = false")
        self._check_from_sum()
        targets = self.lora_targets
        object.__setattr__(self, "lora_targets", tuple(t.strip() for t in (targets.split(",") if isinstance(
            targets, str) else targets) if t.strip()))
        self.adapter_spec  # refuses a bad rank, alpha or dropout here, by name

    def _check_from_sum(self) -> None:
        """``from_sum`` needs vectors whose sum is the model trained last: not ``sequential``'s (each already holds
        the one before), nor plain LoRA factors (their weight updates B A do not add as the factors do)."""
        plain_lora = self.adapter != "none" and not self.mode.linearized
        if self.from_sum and (self.mode is Mode.SEQUENTIAL or plain_lora):
            what = f"a {self.mode} fine-tuning" + (" with a LoRA adapter" if plain_lora else "")
            raise ConfigError(f"recipe.from_sum: {what} cannot start from the earlier vectors' sum (sequential "
                              "starts from the previous weights; plain LoRA vectors do not add); use linear or taujp")

    @property
    def adapter_spec(self) -> LoraSpec | None:
        """The LoRA adapter this recipe trains (A0 drawn from the recipe's seed), or None for full vectors."""
        return LoraSpec.from_fields(dataclasses.asdict(self))

    @property
    def label(self) -> str:
        """How default bank and run directories name this recipe's vectors: the mode, plus ``-lora`` with an
        adapter (adapter and full vectors never share a bank)."""
        penalty = "-kfac" if self.penalty == "kfac" and self.mode.penalized else ""
        return f"{self.mode}{penalty}" + (f"-{self.adapter}" if self.adapter != "none" else "")

    @property
    def reg_batch_size(self) -> int:
        return self.reg_batch if self.reg_batch is not None else max(1, self.batch_size // 8)

    def labelled_rows(self, regularizer: Regularizer | None) -> int:
        """Labelled examples per micro-batch: the batch size, less the reg rows ``regularizer`` draws a step that
        are part of the batch (``reg_within_batch``: all of them, or a count of them; under ``strict`` a step
        draws from every source, so with all of them the labelled rows shrink as sources are added). Refuses a
        batch the reg rows would fill."""
        if not self.reg_within_batch or regularizer is None or not regularizer.active:
            return self.batch_size
        drawn = regularizer.rows_per_step
        within = drawn if self.reg_within_batch is True else min(self.reg_within_batch, drawn)
        rows = self.batch_size - within
        if rows < 1:
            raise ConfigError(
                f"recipe.reg_within_batch: a step draws {drawn} reg rows, {within} of them within the batch, which "
                f"leaves no labelled row of a batch of {self.batch_size}; raise batch_size or lower reg_batch")
        return rows

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup * self.steps)) if self.warmup < 1 else int(self.warmup)

    @property
    def regularized(self) -> bool:
        return self.mode.penalized and self.lam > 0

    def regularizer(self, sources: Sequence[UnlabeledSource], *, shard: Shard | None = None) -> Regularizer:
        """The penalty this recipe asks for over ``sources``: the one place a recipe becomes a regularizer,
        so editkit's stream and the Avalanche plugin penalise alike (they promise the same vectors)."""
        from editkit.core.taujp import Regularizer

        return Regularizer(sources, lam=self.lam, schedule=self.schedule, batch_size=self.reg_batch_size,
                           squared=self.squared, shard=shard, measure=self.penalty_on)

    def curvature_regularizer(self, curvatures: Sequence[Curvature]) -> CurvatureRegularizer:
        """The data-free penalty (``penalty = "kfac"``) over the seen tasks' ``curvatures``."""
        from editkit.core.curvature import CurvatureRegularizer

        return CurvatureRegularizer(curvatures, lam=self.lam, squared=self.squared, combine=self.curvature_combine,
                                    energy=self.curvature_energy, precision=self.curvature_precision)

    def examples_per_step(self, regularizer: Regularizer | None = None) -> int:
        """Labelled examples per optimizer step (all micro-batches, all processes), with ``regularizer``'s reg
        rows out of the batch where ``reg_within_batch`` takes them in (:meth:`labelled_rows`)."""
        return self.labelled_rows(regularizer) * self.accumulation

    def steps_per_epoch(self, train_size: int, regularizer: Regularizer | None = None) -> int:
        """Optimizer steps of one pass over ``train_size`` labelled examples (the last one partial)."""
        return max(1, math.ceil(train_size / self.examples_per_step(regularizer)))

    def resolved(self, train_size: int, regularizer: Regularizer | None = None) -> "Recipe":
        """The recipe a run trains with, for a train split of ``train_size`` examples penalised by
        ``regularizer`` (the one the run builds from this recipe; None: no penalty).

        ``steps``: without ``epochs`` as given; with it, ``ceil(epochs * steps_per_epoch(train_size,
        regularizer))`` (``epochs`` is kept as a record): an epoch is a pass over the labelled examples, so where
        reg rows take places in the batch it takes more steps than ``train_size / batch_size``. An adapter run's
        ``lora_lr``, when set, becomes its ``lr`` (so a bank records the step it was trained with, whichever
        field gave it).
        """
        recipe = self
        if self.adapter != "none" and self.lora_lr is not None:
            recipe = dataclasses.replace(recipe, lr=self.lora_lr, lora_lr=None)
        if self.epochs is None:
            return recipe
        steps = max(1, math.ceil(self.epochs * self.steps_per_epoch(train_size, regularizer) - 1e-9))
        return dataclasses.replace(recipe, steps=steps)

    def with_overrides(self, **overrides: Any) -> "Recipe":
        """A copy with the given fields replaced; ``None`` values mean "keep".

        ``steps`` given without ``epochs`` clears this recipe's ``epochs``.
        """
        return from_mapping({k: v for k, v in overrides.items() if v is not None}, base=self)

    def to_dict(self) -> dict[str, Any]:
        """All fields; ``epochs`` and ``lora_lr`` only when set, ``penalty_on``, ``reg_within_batch`` and
        ``from_sum`` only when not the default, the adapter's fields only with an adapter and the data-free penalty's only with it
        (``curvature_precision`` only when not fp32; banks written before they existed compare equal)."""
        values = dataclasses.asdict(self)
        for name in ("epochs", "lora_lr"):
            if values[name] is None:
                del values[name]
        if values["penalty_on"] == "features":
            del values["penalty_on"]
        for name in ("reg_within_batch", "from_sum"):
            if not values[name]:
                del values[name]
        if values["penalty"] == "inputs":
            for name in ("penalty", *CURVATURE_FIELDS):
                del values[name]
        elif values["curvature_precision"] == "fp32":
            del values["curvature_precision"]
        if values["adapter"] == "none":
            for name in [n for n in values if n == "adapter" or n.startswith("lora_")]:
                del values[name]
        else:
            values["lora_targets"] = list(values["lora_targets"])
        return values


def plain_training(recipe: Recipe) -> dict[str, Any]:
    """:meth:`Recipe.to_dict` without :data:`VECTOR_FIELDS` and the adapter's: what training the plain network with
    the recipe's optimizer (lr, weight decay, warmup, clip), batch, steps and seed depends on (a strategy's run;
    ``schedule``, the reg rows' draw, is the penalty's)."""
    return {k: v for k, v in recipe.to_dict().items()
            if k not in VECTOR_FIELDS and k != "adapter" and not k.startswith("lora_")}


def label_parts(label: str) -> tuple[str, str]:
    """(mode, adapter) of a :attr:`Recipe.label`: ``taujp-lora`` -> (taujp, lora), ``taujp`` -> (taujp, none);
    a data-free penalty's ``-kfac`` stays with the mode's part (``taujp-kfac-lora`` -> (taujp-kfac, lora))."""
    for adapter in ADAPTERS:
        if adapter != "none" and label.endswith(f"-{adapter}"):
            return label[: -len(adapter) - 1], adapter
    return label, "none"


def recipe_differences(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The fields (sorted) in which a banked vector's recorded recipe and a run's recipe (both as
    :meth:`Recipe.to_dict` writes them) differ. In a mode without the penalty its fields are not compared:
    they did not shape the vector, so a bank of plain vectors stays usable when a scenario changes its reg
    batch."""
    keys = set(recorded) | set(wanted)
    if not Mode(wanted["mode"]).penalized:
        keys -= set(PENALTY_FIELDS)
    return sorted(k for k in keys if not _same(recorded.get(k), wanted.get(k)))


def _same(a: Any, b: Any) -> bool:
    """Equal, and a flag on both sides or on neither: ``reg_within_batch`` true (every reg row) is not a count
    of 1, though Python's ``True == 1``."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def describe_differences(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> str:
    """:func:`recipe_differences` as one line for a refusal, each field with both values
    (``"lam 0.1 banked, 0.5 now, steps 100 banked, 50 now"``); empty when the recipes agree."""
    return ", ".join(f"{k} {recorded.get(k)!r} banked, {wanted.get(k)!r} now"
                     for k in recipe_differences(recorded, wanted))


def from_mapping(values: Mapping[str, Any], base: Recipe | None = None) -> Recipe:
    """Build a recipe from a scenario file's table, refusing unknown keys by name."""
    known = {f.name for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown recipe field(s) {unknown}; known: {sorted(known)}")
    values = dict(values)
    if values.get("steps") is not None and values.get("epochs") is not None:
        raise ConfigError(f"give steps or epochs, not both (got steps = {values['steps']}, epochs = {values['epochs']})")
    if "steps" in values and "epochs" not in values:
        values["epochs"] = None  # steps given here beat epochs inherited from the base
    return dataclasses.replace(base or Recipe(), **values)


def attach_adapter(module: nn.Module, recipes: Iterable[Recipe | Mapping[str, Any]]) -> LoraSpec | None:
    """Put the adapter ``recipes`` ask for on ``module`` (theta_0 of every task, so all must ask for the same
    one; recipes may be a bank's recorded dictionaries); returns its spec, or None for full vectors."""
    specs = {r.adapter_spec if isinstance(r, Recipe) else LoraSpec.from_fields(r) for r in recipes}
    if len(specs) > 1:
        described = sorted(s.describe() if s is not None else "no adapter" for s in specs)
        raise ConfigError(f"the tasks ask for different adapters ({'; '.join(described)}): their vectors could not "
                          "be combined; give every task the same adapter fields")
    spec = specs.pop() if specs else None
    return attach_lora(module, spec) if spec is not None else None
