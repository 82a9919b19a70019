"""smmd-scale: Smooth-MMD numeric loss for vocabulary-parallel LLM training.

    vocab = smmd_scale.NumericVocab.from_tokenizer(tokenizer)
    out = smmd_scale.smmd_cross_entropy(logits, targets, smmd_scale.SMMDLoss(vocab), weight=1.0)
    out.total.backward()
"""

from .fused_linear import linear_smmd_cross_entropy
from .integrations import install, vocab_parallel_smmd_cross_entropy
from .loss import SMMDOutput, smmd_cross_entropy
from .ntl import NTLoss
from .numeric_loss import NumericLoss, WeightedNumericLosses
from .smmd import SMMDLoss
from .vocab import NumericVocab

__version__ = "0.1.0"

__all__ = ["NTLoss", "NumericLoss", "NumericVocab", "SMMDLoss", "SMMDOutput", "WeightedNumericLosses", "install",
           "linear_smmd_cross_entropy", "smmd_cross_entropy", "vocab_parallel_smmd_cross_entropy", "__version__"]
