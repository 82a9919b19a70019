"""smmd-scale: numeric-aware losses (SMMD, NTL, DIST2, Gaussian label smoothing, DEL) next to
cross-entropy, for vocabulary-parallel LLM training.

    vocab = smmd_scale.NumericVocab.from_tokenizer(tokenizer)
    out = smmd_scale.numeric_cross_entropy(logits, targets, smmd_scale.SMMDLoss(vocab), weight=1.0)
    out.total.backward()                      # out.ce, out.numeric, out.stats

Second-round names (``smmd_cross_entropy``, ``linear_smmd_cross_entropy``, ``SMMDOutput``,
``vocab_parallel_smmd_cross_entropy``) and the second-round ``install(model, vocab, weight,
numeric_loss=None, **smmd_options)`` remain for one release and warn.
"""

from .digit_entropy import DigitEntropyLoss
from .fused_linear import linear_numeric_cross_entropy, linear_smmd_cross_entropy
from .integrations import install, vocab_parallel_numeric_cross_entropy, vocab_parallel_smmd_cross_entropy
from .loss import NumericOutput, SMMDOutput, numeric_cross_entropy, smmd_cross_entropy
from .ntl import NTLoss
from .number_level import NumberLevelNTLoss
from .numeric_loss import NumericLoss, WeightedNumericLosses
from .registry import NUMERIC_LOSSES, build_numeric_loss
from .smmd import SMMDLoss
from .soft_target import DIST2Loss, GaussianLabelSmoothingLoss
from .vocab import NumericVocab

__version__ = "0.2.0"


def __getattr__(name: str):
    """``NumericLossCallback`` (a ``transformers.TrainerCallback``), imported on first use."""
    if name == "NumericLossCallback":
        from .integrations.hf_callback import NumericLossCallback

        return NumericLossCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DIST2Loss", "DigitEntropyLoss", "GaussianLabelSmoothingLoss", "NTLoss", "NUMERIC_LOSSES",
           "NumberLevelNTLoss", "NumericLoss", "NumericLossCallback", "NumericOutput", "NumericVocab", "SMMDLoss",
           "WeightedNumericLosses", "build_numeric_loss", "install", "linear_numeric_cross_entropy",
           "numeric_cross_entropy", "vocab_parallel_numeric_cross_entropy", "__version__",
           # deprecated aliases, one release
           "SMMDOutput", "linear_smmd_cross_entropy", "smmd_cross_entropy", "vocab_parallel_smmd_cross_entropy"]
