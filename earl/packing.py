"""Sequence packing: token-budget micro-batches and a packed (padding-free) forward for HF models.

Samples of different lengths are concatenated into one row of ``T`` tokens with positions reset
per sample (``cu_seqlens`` marks the boundaries). Nothing is padded and nothing is truncated:
a sample longer than the token budget becomes a micro-batch of its own.

The packed forward works for HF decoder-only models whose attention goes through transformers'
``AttentionInterface`` (Qwen2, Llama, ... in transformers 5.x). Two attention modes:

``"varlen"`` (default): a registered attention function runs causal SDPA per sample — compute is
    ``sum(L_i^2)``, like flash-attention's varlen kernel, on any device.
``"mask"``: transformers' own SDPA with a block-diagonal causal mask derived from the reset
    ``position_ids`` — compute is ``T^2``; kept as the reference and for comparison.

This module knows nothing of losses or optimizers; see ``earl.stages.trainer``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

AttnMode = Literal["varlen", "mask"]
VARLEN_ATTN = "earl_varlen"


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``token_budget`` tokens.

    First-fit decreasing bin packing (deterministic). A sample longer than the budget gets a
    micro-batch to itself, so nothing is ever truncated.

    Args:
        lengths: token count of each sample.
        token_budget: max tokens per micro-batch.

    Returns:
        Lists of sample indices, each list one micro-batch (indices ascending within it).
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive (e.g. 4096), got {token_budget}")
    if any(n <= 0 for n in lengths):
        raise ValueError("every sample needs at least one token; got an empty sample")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(token_budget - n)
    return [sorted(b) for b in bins]


@dataclass(kw_only=True, slots=True)
class Packed:
    """Several samples packed into one row.

    Attributes:
        input_ids: ``[T]`` int64 tokens of all samples, concatenated.
        position_ids: ``[T]`` position within its own sample (restarts at 0).
        seq_ids: ``[T]`` index (0..n-1) of the sample each token belongs to.
        cu_seqlens: ``[n + 1]`` int32 cumulative lengths (``[0, L0, L0+L1, ...]``).
        max_seqlen: length of the longest sample.
    """

    input_ids: Tensor
    position_ids: Tensor
    seq_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def pack(sequences: Sequence[Tensor]) -> Packed:
    """Concatenate 1-D token tensors into a ``Packed`` row."""
    if not sequences:
        raise ValueError("pack() needs at least one sequence")
    lengths = torch.tensor([s.numel() for s in sequences], dtype=torch.long)
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    seq_ids = torch.repeat_interleave(torch.arange(len(sequences)), lengths)
    starts = torch.repeat_interleave(cu[:-1].long(), lengths)
    position_ids = torch.arange(int(cu[-1])) - starts
    return Packed(
        input_ids=torch.cat([s.reshape(-1).long() for s in sequences]),
        position_ids=position_ids,
        seq_ids=seq_ids,
        cu_seqlens=cu,
        max_seqlen=int(lengths.max()),
    )


def _varlen_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Causal attention per packed sample; ``query`` is ``[1, H, T, D]``, output ``[1, T, H, D]``.

    With ``earl_segments`` (a shared-prefix layout, `earl.packing_prefix.shared_forward`) each
    sample also sees the prefix it shares with others, through the attention function the
    caller passes as ``earl_segment_attention`` (so this module imports nothing above it).
    """
    segments = kwargs.get("earl_segments")
    if segments is not None:
        attend = kwargs["earl_segment_attention"]
        return attend(query, key, value, segments, scaling, dropout), None  # type: ignore[operator]
    cu = kwargs.get("cu_seq_lens_q")
    if not isinstance(cu, Tensor):
        raise TypeError(
            f"attn_implementation={VARLEN_ATTN!r} needs cu_seq_lens_q: call earl.packing.packed_forward"
        )
    bounds = cu.tolist()
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    gqa = key.shape[1] != query.shape[1]
    # split (not slicing): its backward is one concatenation, where each slice's backward
    # would write a zero-filled full-size gradient (O(samples x T) memory traffic)
    qs, ks, vs = (t.split(lengths, dim=2) for t in (query, key, value))
    outs = [
        F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa
        )
        for q, k, v in zip(qs, ks, vs, strict=True)
    ]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: object, **kwargs: object) -> None:
    return None


def register_varlen_attention() -> str:
    """Register the ``earl_varlen`` attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTN, _varlen_attention)
    AttentionMaskInterface.register(VARLEN_ATTN, _no_mask)
    return VARLEN_ATTN


def set_attention(model: nn.Module, mode: AttnMode) -> None:
    """Switch an HF model to the attention used by ``packed_forward`` for ``mode``."""
    if mode == "varlen":
        name = register_varlen_attention()
    elif mode == "mask":
        name = "sdpa"
    else:
        raise ValueError(f"attention mode {mode!r} unknown; choose 'varlen' or 'mask'")
    model.set_attn_implementation(name)  # type: ignore[operator]


def packed_forward(model: nn.Module, packed: Packed, keep: Tensor | None = None) -> Tensor:
    """Run an HF causal LM on a packed row; returns logits ``[T, V]``, or ``[len(keep), V]``
    for the rows ``keep`` only (the LM head and everything after it run on those rows alone).

    The model must have been prepared with ``set_attention`` (``varlen`` or ``mask``); it may be
    wrapped in ``DistributedDataParallel``.
    """
    inner = getattr(model, "module", model)
    impl = getattr(inner.config, "_attn_implementation", None)
    kwargs: dict[str, object] = {}
    if impl == VARLEN_ATTN:
        kwargs = {"cu_seq_lens_q": packed.cu_seqlens, "cu_seq_lens_k": packed.cu_seqlens,
                  "max_length_q": packed.max_seqlen, "max_length_k": packed.max_seqlen}
    elif impl not in ("sdpa", "eager"):
        raise ValueError(f"model attention {impl!r} cannot run packed; call set_attention first")
    if keep is not None:
        kwargs["logits_to_keep"] = keep
    out = model(
        input_ids=packed.input_ids[None],
        position_ids=packed.position_ids[None],
        attention_mask=None,
        use_cache=False,
        **kwargs,
    )
    return out.logits[0]


def scored_positions(packed: Packed, mask: Tensor) -> Tensor:
    """Indices of the tokens with ``mask > 0`` that have a prediction (not a sample's first).

    Training needs log-probs only there; ``packed_forward(..., keep=at - 1)`` then computes the
    LM head on those rows alone (in RL most tokens are prompt: ~4% carry loss in Tic-Tac-Toe).
    At least one index is returned when ``T >= 2``, so the loss keeps a graph to backpropagate.
    """
    at = torch.nonzero(mask > 0).flatten()
    at = at[~torch.isin(at, packed.cu_seqlens[:-1].to(at.device))]
    if at.numel() == 0 and packed.input_ids.numel() >= 2:
        at = torch.ones(1, dtype=torch.long, device=mask.device)
    return at


def token_logprobs(logits: Tensor, packed: Packed, at: Tensor | None = None) -> Tensor:
    """Log-prob of each token given its sample's prefix, aligned with ``input_ids``.

    ``out[i] = log p(input_ids[i] | tokens of the same sample before i)``; the first token of
    every sample has no prediction and gets 0 (the same convention as ``Trajectory.logprobs``).

    Args:
        logits: ``[T, V]`` from ``packed_forward``; with ``at``, the ``[len(at), V]`` rows
            ``at - 1`` (``packed_forward(..., keep=at - 1)``).
        packed: the packed row.
        at: token indices from ``scored_positions``; every other token gets 0.

    Returns:
        ``[T]`` fp32 log-probs.
    """
    logits = logits.float()
    ids = packed.input_ids.to(logits.device)  # the batch may still be in host memory
    if at is not None:
        at = at.to(logits.device)
        lp = logits.gather(-1, ids[at, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        return lp.new_zeros(packed.input_ids.numel()).index_put((at,), lp)
    prev = logits[:-1]
    lp = prev.gather(-1, ids[1:, None])[:, 0] - torch.logsumexp(prev, dim=-1)
    out = torch.cat([lp.new_zeros(1), lp])
    starts = packed.cu_seqlens[:-1].long().to(out.device)
    return out.index_fill(0, starts, 0.0)


def token_entropy(logits: Tensor, packed: Packed, at: Tensor | None = None) -> Tensor:
    """Entropy of the distribution each token was sampled from, aligned like ``token_logprobs``
    (``logits`` and ``at`` as there)."""
    from earl.algorithms.entropy import entropy_from_logits

    if at is not None:
        ent = entropy_from_logits(logits)
        return ent.new_zeros(packed.input_ids.numel()).index_put((at.to(ent.device),), ent)
    ent = torch.cat([logits.new_zeros(1, dtype=torch.float32), entropy_from_logits(logits[:-1])])
    return ent.index_fill(0, packed.cu_seqlens[:-1].long().to(ent.device), 0.0)
