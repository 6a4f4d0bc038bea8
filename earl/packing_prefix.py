"""Shared-prefix packing: a prompt that several samples of a micro-batch start with is run once.

The samples of a GRPO group share their prompt token for token (the tools block, the question)
and differ only from the first generated token on; in a short multi-turn task the prompt is most
of each sample, and a system prompt may be common to every sample. `share_prefixes` lays a
packed micro-batch out as a trie: the leading tokens that samples agree on (before their first
trained token) once per distinct prefix, then every sample's own tokens, their positions
continuing from the prefix. Its attention (`shared_attention`, run by the ``earl_varlen``
attention of `earl.packing` when `shared_forward` passes the layout) lets a token see the
segments above it and its own earlier tokens, so each log-prob, and each gradient (summed over
the samples that share a prefix), equals that of the plain packed forward up to rounding, on
fewer tokens.

It knows nothing of losses; the trainer (`earl.stages.trainer_torch`) uses it when
``TrainerConfig.shared_prefix`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from earl.packing import VARLEN_ATTN, Packed

__all__ = ["Segment", "SharedPacked", "share_prefixes", "shared_attention", "shared_forward"]


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows ``[start, end)`` of the shared layout: tokens of one or more samples that see the
    segments ``ancestors`` (all their rows) and their own earlier rows."""

    start: int
    end: int
    ancestors: tuple[int, ...]
    mask: Tensor | None  # [L, ancestors' rows + L] (None: no ancestors, plain causal)


@dataclass(kw_only=True, slots=True)
class SharedPacked:
    """A micro-batch with shared prefixes stored once.

    Attributes:
        input_ids: ``[S]`` tokens in the shared layout (S <= T of the plain packing).
        position_ids: ``[S]`` position of each token within its sample.
        segments: contiguous, in row order; a segment's ancestors come before it.
        rows: ``[T]`` the row in this layout of each token of the plain packing.
    """

    input_ids: Tensor
    position_ids: Tensor
    segments: list[Segment]
    rows: Tensor


def share_prefixes(packed: Packed, loss_mask: Tensor) -> SharedPacked:
    """The shared layout of `packed`: a trie of the samples' prefixes, where a sample's prefix
    is its tokens before its first trained token (``loss_mask > 0``; a sample with none is all
    prefix). Samples share every leading token they agree on there (a system prompt common to
    all, then a group's question), then each has its own segment."""
    ids, cu = packed.input_ids.cpu(), packed.cu_seqlens.tolist()
    trained = loss_mask.cpu() > 0
    seqs = [ids[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]
    cuts = []
    for i, seq in enumerate(seqs):
        hit = torch.nonzero(trained[cu[i]:cu[i + 1]]).flatten()
        cuts.append(int(hit[0]) if hit.numel() else len(seq))
    b = _Builder(ids, cu)
    b.split(list(range(len(seqs))), 0, (), seqs, cuts)
    return SharedPacked(input_ids=torch.cat(b.ids), position_ids=torch.cat(b.pos),
                        segments=b.segments, rows=b.rows)


class _Builder:
    def __init__(self, ids: Tensor, cu: list[int]) -> None:
        self.cu = cu
        self.ids: list[Tensor] = []
        self.pos: list[Tensor] = []
        self.segments: list[Segment] = []
        self.rows = torch.empty(len(ids), dtype=torch.long)
        self.at = 0

    def add(self, tokens: Tensor, depth: int, ancestors: tuple[int, ...],
            members: list[int]) -> int:
        """A segment of `tokens` at positions depth.. shared by `members`; its index."""
        n = len(tokens)
        seen = sum(self.segments[a].end - self.segments[a].start for a in ancestors)
        mask = None
        if ancestors:
            mask = torch.ones(n, seen + n, dtype=torch.bool)
            mask[:, seen:] = torch.ones(n, n, dtype=torch.bool).tril()
        for i in members:
            s = self.cu[i] + depth
            self.rows[s:s + n] = torch.arange(self.at, self.at + n)
        self.ids.append(tokens)
        self.pos.append(torch.arange(depth, depth + n))
        self.segments.append(Segment(start=self.at, end=self.at + n, ancestors=ancestors,
                                     mask=mask))
        self.at += n
        return len(self.segments) - 1

    def split(self, members: list[int], depth: int, ancestors: tuple[int, ...],
              seqs: list[Tensor], cuts: list[int]) -> None:
        """Lay out `members`, which agree on their first `depth` tokens (`ancestors`)."""
        if len(members) == 1:
            (i,) = members
            if len(seqs[i]) > depth:
                self.add(seqs[i][depth:], depth, ancestors, members)
            return
        limit = min(cuts[i] for i in members)
        first = seqs[members[0]]
        common = limit - depth
        for i in members[1:]:
            if common <= 0:
                break
            diff = torch.nonzero(seqs[i][depth:depth + common] != first[depth:depth + common])
            if diff.numel():
                common = int(diff[0, 0])
        if common > 0:
            node = self.add(first[depth:depth + common], depth, ancestors, members)
            ancestors, depth = ancestors + (node,), depth + common
        parts: dict[int, list[int]] = {}
        for i in members:
            if cuts[i] <= depth:  # its shared part ends here: the rest is its own
                if len(seqs[i]) > depth:
                    self.add(seqs[i][depth:], depth, ancestors, [i])
            else:
                parts.setdefault(int(seqs[i][depth]), []).append(i)
        for part in parts.values():
            self.split(part, depth, ancestors, seqs, cuts)


def shared_attention(query: Tensor, key: Tensor, value: Tensor, segments: list[Segment],
                     scaling: float | None, dropout: float) -> Tensor:
    """Attention over a shared layout; ``query`` is ``[1, H, S, D]``, output ``[1, S, H, D]``."""
    # split (not slicing): its backward is one concatenation (see earl.packing)
    sizes = [g.end - g.start for g in segments]
    qs, ks, vs = (t.split(sizes, dim=2) for t in (query, key, value))
    gqa = key.shape[1] != query.shape[1]
    outs: list[Tensor] = []
    for i, g in enumerate(segments):
        if g.mask is None:
            outs.append(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True,
                                                       scale=scaling, dropout_p=dropout,
                                                       enable_gqa=gqa))
            continue
        kk = torch.cat([ks[a] for a in g.ancestors] + [ks[i]], dim=2)
        vv = torch.cat([vs[a] for a in g.ancestors] + [vs[i]], dim=2)
        outs.append(F.scaled_dot_product_attention(qs[i], kk, vv, attn_mask=g.mask.to(
            query.device), scale=scaling, dropout_p=dropout, enable_gqa=gqa))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous()


def shared_forward(model: nn.Module, sp: SharedPacked, keep: Tensor) -> Tensor:
    """Logits ``[len(keep), V]`` at the rows ``sp.rows[keep]`` (``keep`` indexes the plain
    packing, as for `earl.packing.packed_forward`). The model must be set to the ``varlen``
    attention (`earl.packing.set_attention`)."""
    inner = getattr(model, "module", model)
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if impl != VARLEN_ATTN:
        raise ValueError(f"shared-prefix packing needs the {VARLEN_ATTN!r} attention, the model "
                         f"has {impl!r}; call earl.packing.set_attention(model, 'varlen')")
    dev = sp.input_ids.device
    out = model(input_ids=sp.input_ids[None], position_ids=sp.position_ids[None],
                attention_mask=None, use_cache=False, earl_segments=sp.segments,
                earl_segment_attention=shared_attention,
                logits_to_keep=sp.rows.to(dev)[keep])
    return out.logits[0]
