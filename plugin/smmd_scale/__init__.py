"""smmd-scale: numeric-aware losses (SMMD, NTL, DIST2, Gaussian label smoothing, DEL) next to
cross-entropy, for vocabulary-parallel LLM training.

    vocab = smmd_scale.NumericVocab.from_tokenizer(tokenizer)
    out = smmd_scale.numeric_cross_entropy(logits, targets, smmd_scale.SMMDLoss(vocab), weight=1.0)
    out.total.backward()                      # out.ce, out.numeric, out.stats

The second-round names (``smmd_cross_entropy``, ``linear_smmd_cross_entropy``, ``SMMDOutput``,
``vocab_parallel_smmd_cross_entropy``, ``install(model, vocab, ...)``) were removed in 0.3.0; each is
refused by name with what replaced it (``removed.py``).
"""

from .digit_entropy import DigitEntropyLoss
from .dist2 import DIST2Loss
from .fused_linear import linear_numeric_cross_entropy
from .gauss_ls import GaussianLabelSmoothingLoss
from .integrations import install, vocab_parallel_numeric_cross_entropy
from .loss import NumericOutput, numeric_cross_entropy
from .ntl import NTLoss
from .number_level import NumberLevelNTLoss
from .numeric_loss import NumericLoss, WeightedNumericLosses
from .registry import NUMERIC_LOSSES, build_numeric_loss
from .removed import module_attribute
from .smmd import SMMDLoss
from .vocab import NumericVocab

__version__ = "0.3.0"


def __getattr__(name: str):
    """``NumericLossCallback`` (a ``transformers.TrainerCallback``), imported on first use; a name
    removed in 0.3.0 is refused with what replaced it."""
    if name == "NumericLossCallback":
        from .integrations.hf_callback import NumericLossCallback

        return NumericLossCallback
    return module_attribute(__name__, name)


__all__ = ["DIST2Loss", "DigitEntropyLoss", "GaussianLabelSmoothingLoss", "NTLoss", "NUMERIC_LOSSES",
           "NumberLevelNTLoss", "NumericLoss", "NumericLossCallback", "NumericOutput", "NumericVocab", "SMMDLoss",
           "WeightedNumericLosses", "build_numeric_loss", "install", "linear_numeric_cross_entropy",
           "numeric_cross_entropy", "vocab_parallel_numeric_cross_entropy", "__version__"]
