"""The run's loss as the rest of the trainer asks for it: one :class:`LossReporter`, chosen once from
the command line (:func:`loss_reporter`), of which the plan, the train loop, the held-out evaluation,
the HParams columns, the resume record and the sweep's run names ask what the loss is, how it is set
up and what each micro-batch reported.

    NumericLossReporter   smmd_scale's CE + numeric loss (``--numeric_loss``), installed on the LM head
    ModelLossReporter     the model's own loss (``--framework_loss``): CE alone, no numeric statistics

    reporter = loss_reporter(config)                  # from the run's configuration alone
    reporter.label, reporter.hparams()                # the sweep's run names, the HParams columns
    warnings = reporter.plan(vocab, dot_token_ids, vocab_size)    # builds the numeric loss
    reporter.install(engine)                          # the log line; then, per micro-batch:
    reporter.record_micro_batch(monitor, engine(**inputs).loss)
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod

from smmd_scale.registry import NUMERIC_LOSSES, note_reader

from ..config.arguments import VOCAB_FLAGS


def loss_reporter(config) -> LossReporter:
    """The reporter of the loss the run of ``config`` (``smmd_train.config.run_config.RunConfig``) trains on."""
    return ModelLossReporter(config) if config.loss.framework_loss else NumericLossReporter(config)


class LossReporter(ABC):
    """What the rest of the trainer asks of a run's loss.

    ``numeric_loss``: the smmd_scale numeric loss the run installs (None: it installs none).
    ``evaluates``: whether the held-out metrics (``smmd_train.components.evaluation``) can be computed: they
    are the installed loss's statistics (``installed``) on held-out batches."""

    numeric_loss = None
    evaluates = False

    def __init__(self, config):
        self.config = config  # smmd_train.config.run_config.RunConfig
        self.settings = config.loss  # its loss section

    @property
    @abstractmethod
    def label(self) -> str:
        """The loss part of a sweep's run names (``smmd_train.tools.scaling.run_label``): ``ce``, ``smmd+ntl-was``."""

    @abstractmethod
    def terms(self) -> tuple:
        """The run's numeric losses and their weights, ``((name, weight), ...)``; () for none."""

    @abstractmethod
    def hparams(self) -> dict:
        """The HParams column ``numeric_loss``: what the run trains on, as the table shows it."""

    @abstractmethod
    def objective_record(self, vocab) -> dict:
        """What the loss computes, flag by flag, for a checkpoint's resume record
        (``smmd_train.checkpoint.experiment``)."""

    @abstractmethod
    def plan(self, vocab, dot_token_ids, vocab_size: int) -> list:
        """Build what the run installs on ``vocab`` (the plan's numeric vocabulary; ``dot_token_ids``: the
        tokenizer's decimal points) for a model of ``vocab_size`` rows; returns the plan's warnings.
        Raises ValueError, in the words of train.py's flags, for options the loss refuses."""

    @abstractmethod
    def install(self, engine) -> str:
        """Put the loss on ``engine``'s model; returns the line the run logs about it."""

    @abstractmethod
    def counts_steps(self, tp_size: int) -> bool:
        """Whether the train loop passes each micro-batch the optimizer step's counts (then its loss is its
        share of the step's objective; ``smmd_train.run.step_counts``), at tensor-parallel degree ``tp_size``."""

    @abstractmethod
    def numeric_token_ids(self, vocab):
        """The token ids whose targets the step counts as numeric (``num_numeric_in_batch``), or None."""

    @abstractmethod
    def record_micro_batch(self, monitor, loss) -> None:
        """Hand ``monitor`` (``smmd_train.monitor.training.TrainingMonitor``) the parts of the micro-batch whose
        forward just returned ``loss``."""

    def exchange_bounds(self, micro_batches: list, tp_size: int, vocab) -> list:
        """Per micro-batch, the numeric rows its loss's vocabulary-parallel exchange carries, or None
        (``--tp_exchange_capacity counted``: see :class:`NumericLossReporter`)."""
        return [None] * len(micro_batches)

    @abstractmethod
    def bound_next_exchange(self, bound) -> None:
        """Set the next forward's exchange bound (one of :meth:`exchange_bounds`; None: the option's own)."""


class NumericLossReporter(LossReporter):
    """smmd_scale's CE + numeric loss (``--numeric_loss`` and its options), installed with
    ``smmd_scale.install`` on the (possibly vocabulary-parallel) LM head."""

    evaluates = True

    def __init__(self, config):
        super().__init__(config)
        self.installed = None  # smmd_scale.InstalledLoss, from install()

    @property
    def label(self) -> str:
        if all(weight == 0 for _, weight in self.settings.numeric_loss):
            return "ce"
        return "+".join(name for name, _ in self.settings.numeric_loss)

    def terms(self) -> tuple:
        return tuple(self.settings.numeric_loss)

    def hparams(self) -> dict:
        return {"numeric_loss": " + ".join(f"{weight:g} {name}" for name, weight in self.settings.numeric_loss)}

    def objective_record(self, vocab) -> dict:
        return objective_record(self.settings, vocab)

    def plan(self, vocab, dot_token_ids, vocab_size: int) -> list:
        self.numeric_loss = numeric_loss(self.settings, vocab, dot_token_ids)
        if self.settings.numeric_values == "shuffled" and not self.numeric_loss.reads_values:
            terms = " ".join(f"{name}:{weight:g}" for name, weight in self.settings.numeric_loss)
            raise ValueError(f"--numeric_values shuffled would change nothing this run trains: no loss of "
                             f"--numeric_loss {terms} with a weight above 0 reads the numeric tokens' values (DEL "
                             "reads which digit a token is, not its value); the control is for a loss that reads them")
        return numeric_scale_warnings(self.numeric_loss, vocab_size)

    def install(self, engine) -> str:
        import smmd_scale

        self.installed = smmd_scale.install(engine, self.numeric_loss, fused_linear=self.settings.fused_linear,
                                            ce_options=ce_options(self.settings))
        return f"{self.installed!r} ({'vocab-parallel' if self.installed.vocab_parallel else 'full logits'})"

    def counts_steps(self, tp_size: int) -> bool:
        return True

    def numeric_token_ids(self, vocab):
        return vocab.token_ids

    def record_micro_batch(self, monitor, loss) -> None:
        installed = self.installed
        if self.settings.fused_linear and installed.last_path != "fused_linear":
            raise RuntimeError("--fused_linear is installed but this training step computed the logits (the fused "
                               "path runs only for a training-mode forward with labels)")
        bound = installed.hook.ce_options.get("numeric_capacity")
        if isinstance(bound, int) and installed.last_stats["numeric_tokens"] > bound:  # (the device asserts it on
            # a GPU; on the CPU's plan the exchange does not read the bound: checked here, from the statistics)
            raise RuntimeError(f"--tp_exchange_capacity counted: the micro-batch's loss saw "
                               f"{installed.last_stats['numeric_tokens']} numeric-target positions, more than the "
                               f"{bound} counted for it")
        monitor.record_micro_batch(installed.hook.last_losses, installed.last_stats,
                                   z=installed.hook.last_z if self.settings.z_loss else None)

    def exchange_bounds(self, micro_batches: list, tp_size: int, vocab) -> list:
        """``--tp_exchange_capacity counted`` under tensor parallelism: each micro-batch's numeric-target
        positions on this rank (its tensor-parallel peers hold the same micro-batch and count the same),
        counted on the device and read with one host read per optimizer step, beside the step's own counts:
        each call's exchange then carries exactly that many numeric rows and reads nothing back. Else Nones."""
        if self.settings.tp_exchange_capacity != "counted" or tp_size == 1:
            return super().exchange_bounds(micro_batches, tp_size, vocab)
        import torch

        from ..distributed.sequence_parallel import local_target_counts, step_targets

        return torch.stack([local_target_counts(step_targets(inputs), vocab.token_ids)[1]
                            for inputs in micro_batches]).tolist()

    def bound_next_exchange(self, bound) -> None:
        options = self.installed.hook.ce_options
        if bound is not None:
            options["numeric_capacity"] = max(int(bound), 1)  # (at least 1: a call without numbers carries 1 row)
        elif self.settings.tp_exchange_capacity == "counted":
            options.pop("numeric_capacity", None)


class ModelLossReporter(LossReporter):
    """The model's own loss (``--framework_loss``: HF's CE, or DeepSpeed's vocabulary-parallel CE under
    AutoTP), the throughput baseline: nothing is installed, each micro-batch's loss is its CE, and there
    are no numeric statistics (and so no held-out metrics)."""

    label = "ce"

    def terms(self) -> tuple:
        return ()

    def hparams(self) -> dict:
        return {"numeric_loss": "none (framework loss)"}

    def objective_record(self, vocab) -> dict:
        return {"--framework_loss": True}

    def plan(self, vocab, dot_token_ids, vocab_size: int) -> list:
        if self.settings.numeric_values == "shuffled":
            raise ValueError("--numeric_values shuffled would change nothing with --framework_loss: the model's own "
                             "loss reads no numeric values")
        if self.config.model_data.eval_data:
            return ["--eval_data is not evaluated with --framework_loss: the held-out metrics come from the "
                    "installed numeric loss, which a --framework_loss run does not have"]
        return []

    def install(self, engine) -> str:
        return f"the model's own ({type(engine.module.loss_function).__name__}), no numeric loss"

    def counts_steps(self, tp_size: int) -> bool:
        # Under AutoTP the model's own loss is DeepSpeed's vocabulary-parallel CE, which takes no counts:
        # its micro-batches are means, as DeepSpeed users run it.
        return tp_size == 1

    def numeric_token_ids(self, vocab):
        return None

    def record_micro_batch(self, monitor, loss) -> None:
        monitor.record_micro_batch((loss.detach(), loss.detach(), 0.0), None)

    def bound_next_exchange(self, bound) -> None:
        return None  # (the model's own loss: no exchange of ours to bound)


def ce_options(settings) -> dict:
    """The op options of ``settings`` (a ``smmd_train.config.run_config.Loss``: ``--z_loss``, ``--label_smoothing``,
    ``--tp_exchange_capacity``), those that are on. Soft-capping and a logit scale are the model's own (its
    config), which the installed loss reads."""
    return {name: value for name, value in (("z_loss", settings.z_loss), ("label_smoothing", settings.label_smoothing),
                                            ("numeric_capacity", "tokens" if settings.tp_exchange_capacity == "tokens"
                                             else None)) if value}


def numeric_loss(settings, vocab, dot_token_ids=()):
    """The run's numeric loss from ``settings`` (a ``smmd_train.config.run_config.Loss``: ``--numeric_loss`` and the
    options its registry entries declare), on
    ``vocab``: one loss, or their weighted sum (``smmd_scale.WeightedNumericLosses``).
    ``dot_token_ids``: the tokenizer's decimal points, for a loss that reads decimals (DEL)."""
    from smmd_scale.registry import LossOptionError, build_numeric_loss, options_from

    options = options_from(lambda option: settings.options[option.column])
    try:
        return build_numeric_loss(vocab, settings.numeric_loss, options, dot_token_ids=dot_token_ids)
    except LossOptionError as error:  # in the words of the refusing loss's own flags (and the vocabulary's)
        flags = {**VOCAB_FLAGS, **{option.keyword: option.flag for option in error.entry.options}}
        raise ValueError(error.worded(flags)) from None


# What the numeracy study (benchmarks/numeracy) trained each loss whose size follows the values with: a
# study's result, kept with the trainer's warning that cites it, not in the loss package.
STUDY_SETTINGS = {
    "ntl-was": "ntl-was:0.3 with --ntl_squash_factor 9 (distances mapped onto [1, 9], so at most 9.09 per position)",
    "ntl-mse": "ntl-mse:0.0001 on the values 0..999, chosen on validation",
}


def numeric_scale_warnings(loss, vocab_size: int) -> list:
    """One warning per term of ``loss`` whose size follows the numeric values
    (``NumericLoss.value_scale``: NTL-MSE, raw NTL-WAS) and can, at its weight, exceed CE's value for a
    uniform prediction, ln(vocab_size): where CE starts on a fresh model. The warning gives the term's
    possible size and the setting the numeracy study used. SMMD, NTL-WAS on squashed distances and
    number-level NTL are bounded whatever the values: they never warn."""
    from smmd_scale.registry import entry_of

    ce_scale, values = math.log(vocab_size), loss.vocab.values
    warnings = []
    for term, weight in loss.weighted_terms():
        scale = term.value_scale
        if scale is None or weight * scale <= ce_scale:
            continue
        entry = entry_of(term)
        warnings.append(f"--numeric_loss {entry.name}:{weight:g}: {entry.name} grows with the numeric values "
                        f"({float(values.min()):g}..{float(values.max()):g} here): up to {scale:.3g} per position, "
                        f"{weight * scale:.3g} at weight {weight:g}, against CE's ln(vocab_size) = "
                        f"{ce_scale:.1f} for a uniform prediction, so it can drown CE; the numeracy study "
                        f"(benchmarks/numeracy) used {STUDY_SETTINGS[entry.name]}")
    return warnings


# The flags that shape each numeric loss, recorded when it is in --numeric_loss: its registry entry's
# options (NTL-MSE and number-level NTL take no distances, so --ntl_squash_factor is NTL-WAS's alone).
LOSS_FLAGS = {name: tuple(option.column for option in entry.options) for name, entry in NUMERIC_LOSSES.items()}
note_reader(__name__)


def objective_record(settings, vocab) -> dict:
    """What a run on smmd_scale's numeric loss computes, flag by flag (``settings``: the run's
    ``smmd_train.config.run_config.Loss``; ``vocab``: the plan's numeric vocabulary). A run on the model's
    own loss records ``{"--framework_loss": True}`` instead (:class:`FrameworkLoss`)."""
    record = {"--framework_loss": False,
              "--numeric_loss": " ".join(f"{name}:{weight:g}" for name, weight in settings.numeric_loss),
              "--numeric_policy": settings.numeric_policy}
    if settings.numeric_policy != "digits":  # the digits policy has no bound
        record["--numeric_max_value"] = settings.numeric_max_value
    # (a checkpoint from before the flag has no entry, and resumes as "parsed" does)
    record["--numeric_values"] = settings.numeric_values_label
    record["numeric vocabulary"] = vocab_fingerprint(vocab)
    for name, _ in settings.numeric_loss:
        for flag in LOSS_FLAGS[name]:
            record[f"--{flag}"] = settings.options[flag]
    record.update({"--z_loss": settings.z_loss, "--label_smoothing": settings.label_smoothing})
    return record


def vocab_fingerprint(vocab) -> str:
    """``"<N> tokens, sha256 <12 hex>"`` of a ``smmd_scale.NumericVocab``'s ids and values."""
    digest = hashlib.sha256(vocab.token_ids.numpy().astype("<i8").tobytes())
    digest.update(vocab.values.numpy().astype("<f8").tobytes())
    return f"{len(vocab)} tokens, sha256 {digest.hexdigest()[:12]}"
