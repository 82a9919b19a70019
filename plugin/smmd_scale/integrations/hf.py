"""Hugging Face integration: the causal-LM ``loss_function`` hook.

HF models call ``self.loss_function(logits=..., labels=..., vocab_size=..., **kwargs)`` from their
forward (``num_items_in_batch``, ``shift_labels`` and ``ignore_index`` arrive as kwargs). The hook
below is a drop-in for HF's ``ForCausalLMLoss`` that returns CE + weight * a numeric loss, computed on full
logits or — when DeepSpeed AutoTP made the head vocabulary-parallel — on this rank's shard.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .. import compat
from ..fused_linear import linear_numeric_cross_entropy
from ..loss import NumericOutput, numeric_cross_entropy
from ..numeric_loss import IGNORE_INDEX, NumericLoss
from ..removed import module_attribute, removed_error
from ..steps import CallStats


class DetachedLosses(NamedTuple):
    """A call's detached scalar losses: ``total = ce + weight * numeric``."""

    total: torch.Tensor
    ce: torch.Tensor
    numeric: torch.Tensor


class NumericCausalLMLoss:
    """``loss_function`` hook: CE + weight * a numeric loss with HF's causal shift and normalisation.

    ``labels [B, S]`` are shifted like HF does (pad one ``ignore_index`` on the right, drop the
    first), or ``shift_labels`` are used as given. ``num_items_in_batch`` divides CE as in HF;
    ``num_numeric_in_batch`` (pass it to the model's forward like ``num_items_in_batch``) divides
    the numeric term, so that the step's micro-batches add up to the step's objective (see
    :func:`smmd_scale.loss.reduce_losses`). ``sequence_shard`` (passed to the forward the same way;
    :class:`smmd_scale.sequence_shard.SequenceShard`): under sequence parallelism, the whole
    sequence's targets and this rank's slice of them, for the losses that read whole numbers.
    ``ce_options``: keyword options both ops take (``logit_scale``, ``logit_softcap``, ``z_loss``,
    ``label_smoothing``, ``accum_dtype``; docs/objective.md), passed to every call.
    After each call: ``last_stats`` its statistics (floats), ``last_losses`` its
    :class:`DetachedLosses`, ``last_z`` its z-loss (detached; 0 when off), ``last_counts`` the
    (``num_items_in_batch``, ``num_numeric_in_batch``) they were divided by (None: the call's own counts)
    and ``last_path`` how it ran: ``"logits"`` (on the model's logits) or ``"fused_linear"`` (from the
    head's input, no logits). Each call records a new ``last_losses`` object (how :class:`NumericLossCallback`
    tells a fresh call from the last one it recorded; no counter, which ``torch.compile(model)`` would guard
    on and compile again for every call).
    """

    def __init__(self, numeric_loss: NumericLoss, weight: float = 1.0, tp_group=None, vocab_start_index: int = 0,
                 ce_options: Optional[dict] = None):
        self.numeric_loss = numeric_loss
        self.weight = weight
        self.tp_group = tp_group
        self.vocab_start_index = vocab_start_index
        self.last_stats: Optional[dict] = None
        self.last_losses: Optional[DetachedLosses] = None
        self.last_counts: Optional[tuple] = None
        self.last_path: Optional[str] = None
        self.last_z: Optional[torch.Tensor] = None
        self.ce_options = dict(ce_options or {})
        if "reduction" in self.ce_options:
            raise ValueError("the loss_function hook returns the mean loss HF expects; reduction is not a ce_option")
        # (the Trainer's num_items_in_batch object, the step's numeric-target count): InstalledLoss.attach_to_trainer
        self.trainer_step_counts: Optional[tuple] = None

    def __repr__(self):
        where = "full logits" if self.tp_group is None else f"vocab shard from {self.vocab_start_index}"
        return f"{type(self).__name__}(weight={self.weight}, {where}, {self.numeric_loss!r})"

    def shifted(self, labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor],
                ignore_index: int) -> torch.Tensor:
        """The targets of each position: ``shift_labels`` as given, or ``labels`` shifted as HF does."""
        if ignore_index != self.numeric_loss.ignore_index:
            raise ValueError(f"the model asked for ignore_index={ignore_index} but the installed numeric loss "
                             f"({type(self.numeric_loss).__name__}) uses ignore_index="
                             f"{self.numeric_loss.ignore_index}; build it with ignore_index={ignore_index}")
        if shift_labels is not None:
            return shift_labels
        if labels is None:
            raise ValueError("the loss hook needs labels or shift_labels")
        # Pad-and-drop shifts the labels instead of slicing the logits, so the logits are never copied.
        return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]

    def __call__(self, logits: torch.Tensor, labels: Optional[torch.Tensor] = None, vocab_size: Optional[int] = None,
                 num_items_in_batch=None, ignore_index: int = IGNORE_INDEX, shift_labels: Optional[torch.Tensor] = None,
                 num_numeric_in_batch=None, sequence_shard=None, **kwargs) -> torch.Tensor:
        shift_labels = self.shifted(labels, shift_labels, ignore_index)
        num_numeric_in_batch = self.numeric_count_for(num_items_in_batch, num_numeric_in_batch)
        output = self.compute(logits, shift_labels.to(logits.device), num_items_in_batch, num_numeric_in_batch,
                              sequence_shard)
        return output.total

    def numeric_count_for(self, num_items_in_batch, num_numeric_in_batch):
        """The numeric count to use: the one given, else the one counted with the Trainer step whose
        ``num_items_in_batch`` this is (the very object the Trainer passes to every micro-batch)."""
        if num_numeric_in_batch is None and self.trainer_step_counts is not None and num_items_in_batch is not None:
            step_items, step_numeric = self.trainer_step_counts
            if step_items is num_items_in_batch:
                return step_numeric
        return num_numeric_in_batch

    def compute(self, logits: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch=None,
                num_numeric_in_batch=None, sequence_shard=None) -> NumericOutput:
        """The full :class:`NumericOutput` for already-shifted labels (records ``last_*``)."""
        self._release_last_stats()
        output = numeric_cross_entropy(logits, shift_labels, self.numeric_loss, weight=self.weight,
                                       tp_group=self.tp_group, vocab_start_index=self.vocab_start_index,
                                       num_items_in_batch=num_items_in_batch,
                                       num_numeric_in_batch=num_numeric_in_batch, sequence_shard=sequence_shard,
                                       **self.ce_options)
        self._record(output, "logits", (num_items_in_batch, num_numeric_in_batch))
        return output

    def fused_loss(self, head, call_through_module, hidden: torch.Tensor, labels=None, shift_labels=None,
                   num_items_in_batch=None, ignore_index: int = IGNORE_INDEX, num_numeric_in_batch=None,
                   op_options: Optional[dict] = None, sequence_shard=None) -> torch.Tensor:
        """The same loss from the head's input ``hidden [B, S, H]`` without logits
        (:func:`smmd_scale.linear_numeric_cross_entropy`), run as ``head``'s forward through
        ``call_through_module`` so that its weight is gathered and released like the head's own.
        ``op_options``: the op's keywords for the logit transform the model's forward applies
        between its head and its loss (``logit_softcap``, ``logit_scale``), added to ``ce_options``."""
        options = self.fused_options(op_options or {})
        targets = self.shifted(labels, shift_labels, ignore_index).to(hidden.device)
        num_numeric_in_batch = self.numeric_count_for(num_items_in_batch, num_numeric_in_batch)
        outputs = []
        self._release_last_stats()

        def head_loss(hidden_states):
            output = linear_numeric_cross_entropy(hidden_states, head.weight, targets, self.numeric_loss, self.weight,
                                                  bias=getattr(head, "bias", None), tp_group=self.tp_group,
                                                  vocab_start_index=self.vocab_start_index,
                                                  num_items_in_batch=num_items_in_batch,
                                                  num_numeric_in_batch=num_numeric_in_batch,
                                                  sequence_shard=sequence_shard, **options)
            outputs.append(output)
            return output.total

        total = call_through_module(head, head_loss, hidden)
        self._record(outputs[0], "fused_linear", (num_items_in_batch, num_numeric_in_batch))
        return total

    def fused_options(self, op_options: dict) -> dict:
        """``ce_options`` + the model's own logit transform (``op_options``). A transform in both is
        refused: on logits the hook would apply its own after the model's (e.g. scale the soft-capped
        logits), which the fused op, transforming once, does not compute."""
        transforms = ("logit_scale", "logit_softcap")
        mine = {key: self.ce_options[key] for key in transforms if self.ce_options.get(key) is not None}
        if op_options and mine:
            raise ValueError(f"the model's forward already transforms its logits ({op_options}) and the loss hook's "
                             f"ce_options add {mine} on top; the fused head cannot apply both; drop {sorted(mine)} "
                             "from ce_options")
        return {**self.ce_options, **op_options}

    def numeric_labels(self, batch: dict) -> dict:
        """``batch`` with its ``labels`` (and ``shift_labels``) kept only at numeric targets (the rest
        ``ignore_index``): counting its labels counts numeric-target positions."""
        ignore = self.numeric_loss.ignore_index
        return {**batch, **{key: torch.where(self.numeric_loss.numeric_mask(batch[key]), batch[key], ignore)
                            for key in ("labels", "shift_labels") if key in batch}}

    @property
    def smmd(self):
        """Removed in 0.3.0: :attr:`numeric_loss` (refused by name)."""
        raise removed_error("NumericCausalLMLoss.smmd")

    def _release_last_stats(self) -> None:
        """Before a call: drop the last call's statistics if nobody read them. On an accelerator's plan
        unread statistics hold what they are made from (a few vectors of the call's positions, and its
        plan), which would otherwise live through this call's forward beside its own."""
        if torch.compiler.is_compiling():  # (a compiled call makes its statistics in the graph: nothing to
            return  # release, and reading the last ones here would be a guard that compiles again per state)
        if isinstance(self.last_stats, CallStats) and not self.last_stats.read:
            self.last_stats = None

    def _record(self, output: NumericOutput, path: str, counts: tuple) -> None:
        self.last_stats = output.stats
        self.last_losses = DetachedLosses(output.total.detach(), output.ce.detach(), output.numeric.detach())
        self.last_z = output.z.detach()
        self.last_counts = counts
        self.last_path = path


class InstalledLoss:
    """What :func:`smmd_scale.install` returns: the hook, where it went, and how to undo it."""

    def __init__(self, model, hook: NumericCausalLMLoss, head=None):
        self.model = model
        self.hook = hook
        self.head = head
        self._had_own, self._previous = compat.assigned_loss_function(model)
        self._had_own_forward, self._previous_forward = "forward" in vars(model), vars(model).get("forward")
        self.fused_linear = False

    @property
    def last_stats(self) -> Optional[dict]:
        return self.hook.last_stats

    @property
    def last_path(self) -> Optional[str]:
        """How the last loss call ran: ``"logits"``, ``"fused_linear"`` (no logits), or None before any."""
        return self.hook.last_path

    @property
    def vocab_parallel(self) -> bool:
        return self.hook.tp_group is not None

    def attach_to_trainer(self, trainer) -> None:
        """Make a ``transformers.Trainer`` (or TRL's ``SFTTrainer``) train CE + weight x the numeric loss,
        the same objective for any gradient accumulation: when the Trainer counts a step's tokens for
        ``num_items_in_batch`` (its ``get_batch_samples``), the step's numeric-target positions are
        counted the same way (gathered and divided across devices as the Trainer does) and the hook
        divides the numeric term by them, so each micro-batch returns its share of the step's
        objective. Without it the Trainer's steps weigh each micro-batch's numeric mean by its tokens,
        not by its numbers.

        Also adds a :class:`~smmd_scale.integrations.hf_callback.NumericLossCallback` ahead of the
        Trainer's other callbacks: every training log then holds the loss parts (``loss_ce``,
        ``loss_numeric``, ``loss_smmd``, ..., ``loss_total``) and numeric metrics of its logging
        window, every evaluation the same parts of the evaluation set (``eval_loss_ce``, ...), in
        ``log_history`` and in whatever the Trainer reports to (TensorBoard, W&B); and if the first
        training step never calls the hook, it raises before the optimizer applies that step.

        ``SFTTrainer`` computes its loss without the model's ``loss_function``: its ``compute_loss``
        is replaced by the Trainer's, with TRL's metrics kept (:mod:`smmd_scale.integrations.trl`).
        Refused, before anything changes: a trainer that trains another model than the one
        ``install`` hooked, the Trainer's label smoother (``label_smoothing_factor``), Liger's fused
        linear cross-entropy and an ``SFTTrainer`` whose ``loss_type`` is not ``"nll"``: each
        computes its loss without calling the hook."""
        from .hf_callback import NumericLossCallback
        from .trl import attach_to_sft_trainer, is_sft_trainer

        check_trainer_calls_hook(trainer, self.model)
        if is_sft_trainer(trainer):
            attach_to_sft_trainer(trainer)
        accelerator = trainer.accelerator
        reduce = None if accelerator.num_processes == 1 else (
            lambda sums: accelerator.reduce(sums.to(accelerator.device), reduction="sum"))
        trainer.callback_handler.callbacks.insert(0, NumericLossCallback(self, reduce,
                                                                         trainer_name=type(trainer).__name__))
        fetch = trainer.get_batch_samples
        hook = self.hook

        def get_batch_samples(epoch_iterator, num_batches, device):
            batch_samples, num_items_in_batch = fetch(epoch_iterator, num_batches, device)
            hook.trainer_step_counts = None
            if num_items_in_batch is not None:
                numeric_only = [hook.numeric_labels(batch) for batch in batch_samples]
                hook.trainer_step_counts = (num_items_in_batch,
                                            compat.trainer_count_items(trainer, numeric_only, device))
            return batch_samples, num_items_in_batch

        trainer.get_batch_samples = get_batch_samples

    def restore(self) -> None:
        """Put back the loss function (and, with ``fused_linear``, the forward) the model had before ``install``."""
        if self._had_own:
            self.model.loss_function = self._previous
        else:
            compat.forget_loss_function(self.model)
        if self.fused_linear:
            if self._had_own_forward:
                self.model.forward = self._previous_forward
            else:
                del self.model.forward
            self.fused_linear = False

    def __repr__(self):
        fused = ", fused linear head" if self.fused_linear else ""
        return f"InstalledLoss(on {type(self.model).__name__}{fused}, {self.hook!r})"


def check_trainer_calls_hook(trainer, model) -> None:
    """Refuse (one line: what, and what to do) a ``transformers.Trainer`` set up so that it never calls
    the hook installed on ``model``. What cannot be told from the set-up (a ``compute_loss`` or
    ``compute_loss_func`` of one's own, a model whose forward computes its own loss) is checked at the
    first training step by :class:`~smmd_scale.integrations.hf_callback.NumericLossCallback`."""
    trained = trainer.model
    if not any(module is model for module in trained.modules()):
        raise ValueError(f"{type(trainer).__name__} trains a {type(trained).__name__} that is not (and does not wrap) "
                         f"the {type(model).__name__} smmd_scale.install hooked; install the loss on the model "
                         "passed to the trainer (trainer.model), or build the trainer with that model")
    if trainer.label_smoother is not None:
        factor = trainer.args.label_smoothing_factor
        raise ValueError(f"label_smoothing_factor={factor}: the Trainer's label smoother computes the loss from the "
                         "logits without the hook; set label_smoothing_factor=0 and pass ce_options="
                         f"{{'label_smoothing': {factor}}} to smmd_scale.install")
    liger = trainer.args.liger_kernel_config or {}
    if trainer.args.use_liger_kernel and liger.get("fused_linear_cross_entropy", True):
        raise ValueError("use_liger_kernel=True: Liger's fused linear cross-entropy replaces the model's forward and "
                         "loss, so the hook is never called; pass liger_kernel_config={'fused_linear_cross_entropy': "
                         "False} (smmd_scale.install(..., fused_linear=True) fuses the head with the numeric loss)")


def set_loss_function(model, hook) -> None:
    """Replace ``model.loss_function`` and check that the model really calls the new one."""
    if not hasattr(model, "loss_function"):
        raise TypeError(f"{type(model).__name__} has no loss_function hook; smmd_scale.install needs a Hugging Face "
                        "causal LM (transformers>=4.46)")
    model.loss_function = hook
    if model.loss_function is not hook:
        raise TypeError(f"{type(model).__name__}.loss_function cannot be replaced (read-only or ignoring its "
                        "setter); use numeric_cross_entropy on the model's logits instead")


def __getattr__(name: str):
    return module_attribute(__name__, name)
