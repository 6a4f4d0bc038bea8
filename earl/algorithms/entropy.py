"""Token entropy of the policy's next-token distribution, for an entropy bonus.

The bonus is ``-coef * aggregate(entropy)`` added to the loss (maximising entropy), which keeps
the policy from collapsing to near-deterministic play early in training.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``-sum_v p_v log p_v`` of ``softmax(logits)`` over the last dim, computed stably.

    Args:
        logits: ``[..., V]``.

    Returns:
        ``[...]`` entropies in nats (fp32).
    """
    logits = logits.float()
    logz = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    return logz - (p * logits).sum(dim=-1)
