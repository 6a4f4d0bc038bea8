"""Memory and throughput cost model of one RL stage in one parallel configuration.

Bytes per device for the rollout (weights + KV cache), the reference / experience preparation
(weights + one forward's working set) and training (weights, gradients, optimizer state,
stored activations) stages, from a model's shape. The formulas are first-principles counts of
the tensors each stage keeps; nothing here is fitted to a measurement except through
`CostConfig`'s documented constants. Throughput is a coarse roofline used only where no profile
exists (`earl.runtime.selector.profile` measures the real thing and overrides it).

Calibration against the EARL paper (Llama-3.1-70B needs ~97 GB at 4,096 tokens and ~354 GB at
8,192 "per batch"): the paper's figures are the *activation memory of one training micro-batch
of one sequence on one GPU of an 8-way tensor-parallel group*, bf16, no sequence parallelism, no
activation recomputation, and eager attention (the HF "eager" path keeps the fp32 softmax output
and its bf16 copy: 6 bytes per attention score, which makes memory grow with the square of the
context). `paper_points()` gives 98.4 GB and 327.3 GB (+1.5%, -7.5%). With flash attention the
same point costs 33 GB / 66 GB: the quadratic term, not the weights, is what blows up. On this
machine the same formulas predict the measured peak of a real forward+backward of a 4-layer
Qwen2 within about +-10% (`profile`; eager and SDPA attention, 256-2,048 tokens).

Not here: choosing a configuration (`policy`), measuring (`profile`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

Stage = Literal["rollout", "reference", "train"]
STAGES: tuple[Stage, ...] = ("rollout", "reference", "train")
GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """The numbers of a decoder-only transformer (Llama/Qwen style: SwiGLU MLP, GQA)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    params: int

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "params"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {v!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: hidden ({self.hidden}) must divide by heads "
                             f"({self.heads}) and heads by kv_heads ({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object], params: int | None = None
                       ) -> ModelShape:
        """The shape of a Hugging Face `config.json` (Llama/Qwen2 keys); `params` None: counted
        from the config (tied embeddings counted once, unless `tie_word_embeddings` is false).

        Raises:
            ValueError: a key is missing (named in the message).
        """
        keys = {"hidden": "hidden_size", "layers": "num_hidden_layers",
                "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
                "intermediate": "intermediate_size", "vocab": "vocab_size"}
        missing = [k for k in keys.values() if k not in config]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}: pass a decoder-only "
                             "Llama/Qwen2-style config.json")
        n = {f: int(str(config[k])) for f, k in keys.items()}
        if params is None:
            h, kv = n["hidden"], n["kv_heads"] * (n["hidden"] // n["heads"])
            layer = h * h * 2 + h * kv * 2 + 3 * h * n["intermediate"] + 2 * h + h + 2 * kv
            emb = n["vocab"] * h * (1 if config.get("tie_word_embeddings", True) else 2)
            params = n["layers"] * layer + emb + h
        return cls(params=params, **n)

    @classmethod
    def llama31_70b(cls) -> ModelShape:
        return cls(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672,
                   vocab=128256, params=70_553_706_496)

    @classmethod
    def llama31_8b(cls) -> ModelShape:
        return cls(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                   vocab=128256, params=8_030_261_248)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostConfig:
    """Precision and kernel choices the byte counts depend on.

    Args:
        weight_bytes: bytes per parameter of the weights (2: bf16).
        grad_bytes: bytes per parameter of the gradients (4: fp32 accumulation).
        optimizer_bytes: bytes per parameter of optimizer state (12: fp32 master + Adam m, v),
            sharded over data parallel ranks (distributed optimizer / FSDP).
        act_bytes: bytes per stored activation element (2: bf16).
        kv_bytes: bytes per KV-cache element (2: bf16).
        attention: "eager" materializes the attention scores (quadratic in context); "flash"
            does not.
        score_bytes: bytes kept per attention score with eager attention (6: fp32 softmax
            output + its bf16 copy, as in HF's eager path).
        logit_bytes: bytes per vocabulary entry per trained token (6: bf16 logits + fp32
            log-softmax).
        recompute: always recompute activations (only layer inputs are stored); a layout can
            also ask for it (`Parallel.recompute`).
        sequence_parallel: norm inputs/outputs (and stored layer inputs) split over TP too.
        reserve_bytes: per-device memory the model does not see (CUDA context, allocator slack).
        tp_overhead: throughput lost to communication per doubling of TP (0.06: NVLink GPUs;
            CPU slots lose far more: `bench/parallel.py` measured a TP-2 vLLM replica at 0.77x
            of two TP-1 replicas on the same 2 cores, so a run on CPU devices uses 0.25).
        peak_flops, mem_bw: one device's dense FLOP/s and memory bandwidth (bytes/s), the two
            roofs of `tokens_per_s` (H100 by default). Only their ratio matters to a run (its
            measured rates rescale the roofline): a GPU decodes bandwidth bound up to ~300
            FLOPs per byte, a CPU core is compute bound from ~4.
        decode_step_s: seconds one decode step of a rollout replica costs on one device beyond
            its roofline, whatever its batch (the engine's scheduling and sampling, kernel
            launches): per token it weighs `1 / sequences`, so a replica that decodes fewer
            sequences at once pays more of it. 0 by default (a GPU's is small beside its
            roofline at a cluster's batch); a tiny model on a CPU core pays ~1.3 ms, as much
            as decoding ~200 sequences (`bench/_selector_calibration.py` fits it).
    """

    weight_bytes: float = 2.0
    grad_bytes: float = 4.0
    optimizer_bytes: float = 12.0
    act_bytes: float = 2.0
    kv_bytes: float = 2.0
    attention: Literal["eager", "flash"] = "flash"
    score_bytes: float = 6.0
    logit_bytes: float = 6.0
    recompute: bool = False
    sequence_parallel: bool = False
    reserve_bytes: float = 0.0
    tp_overhead: float = 0.06
    peak_flops: float = 989e12
    mem_bw: float = 3.35e12
    decode_step_s: float = 0.0

    def __post_init__(self) -> None:
        if self.decode_step_s < 0:
            raise ValueError(f"CostConfig.decode_step_s must be >= 0 (seconds per decode "
                             f"step), got {self.decode_step_s}")
        if not 0 <= self.tp_overhead < 1:
            raise ValueError(f"CostConfig.tp_overhead must be in [0, 1), got {self.tp_overhead}")
        if self.peak_flops <= 0 or self.mem_bw <= 0:
            raise ValueError(f"CostConfig.peak_flops and mem_bw must be > 0 (one device's "
                             f"FLOP/s and bytes/s), got {self.peak_flops} and {self.mem_bw}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallel:
    """One actor's parallel layout: tensor x pipeline x data parallel, and whether training
    recomputes activations in the backward (less memory, ~1/3 more compute)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    recompute: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Parallel.{name} must be a positive int, got {v!r}")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"tp{self.tp}/pp{self.pp}/dp{self.dp}" + ("/recompute" if self.recompute else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Memory:
    """Bytes on the busiest device of one configuration, by kind."""

    weights: float
    grads: float = 0.0
    optimizer: float = 0.0
    kv_cache: float = 0.0
    activations: float = 0.0
    reserve: float = 0.0

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.kv_cache + self.activations
                + self.reserve)


class CostModel:
    """Bytes and (roofline) tokens/s of a stage for a model shape.

    Args:
        shape: the model.
        config: precisions and kernels (default `CostConfig()`).
    """

    def __init__(self, shape: ModelShape, config: CostConfig | None = None) -> None:
        self.shape = shape
        self.config = config or CostConfig()

    # ---- per-part byte counts -----------------------------------------------------------
    def weight_bytes(self, par: Parallel) -> float:
        return self.shape.params * self.config.weight_bytes / (par.tp * par.pp)

    def kv_bytes_per_token(self, par: Parallel) -> float:
        """layers x kv_heads x head_dim x 2 (K and V) x dtype bytes, split over TP (KV heads
        are replicated once TP exceeds them) and PP."""
        s = self.shape
        kv_split = min(par.tp, s.kv_heads)
        return s.layers * s.kv_heads * s.head_dim * 2 * self.config.kv_bytes / kv_split / par.pp

    def activation_bytes(self, tokens: int, seq_len: int, par: Parallel) -> float:
        """Activations stored for backward by one micro-batch of `tokens` tokens made of
        sequences of `seq_len` (packed), on the busiest pipeline stage (1F1B keeps `pp`
        micro-batches of `layers / pp` layers: a whole model's worth)."""
        s, c = self.shape, self.config
        t = par.tp
        kv_dim = s.kv_heads * s.head_dim
        # Kept per token per layer: norm inputs and outputs (replicated over TP unless sequence
        # parallel) and, split over TP, q/k/v, the attention output, gate, up, act, product.
        sp = t if c.sequence_parallel else 1
        replicated = 4 * s.hidden / sp
        split = (s.hidden + 2 * kv_dim + s.hidden + 4 * s.intermediate) / t
        per_token_layer = (replicated + split) * c.act_bytes
        if c.attention == "eager":  # scores: heads/tp x seq_len per token
            per_token_layer += s.heads / t * seq_len * c.score_bytes
        logits = s.vocab / t * c.logit_bytes * tokens
        # + one layer: its backward holds gradients as large as its activations (with
        # recompute: the rebuilt layer too)
        if c.recompute or par.recompute:
            inputs = s.layers * s.hidden / sp * c.act_bytes
            return (inputs + 2 * per_token_layer) * tokens + logits
        return (s.layers + 1) * per_token_layer * tokens + logits

    def forward_bytes(self, tokens: int, seq_len: int, par: Parallel) -> float:
        """Working set of a no-grad forward (reference, prefill): one layer's temporaries."""
        s, c = self.shape, self.config
        per_token = (2 * s.hidden + 3 * s.intermediate / par.tp) * c.act_bytes
        if c.attention == "eager":  # scores and probabilities coexist
            per_token += 2 * s.heads / par.tp * seq_len * c.score_bytes
        return (per_token + s.vocab / par.tp * c.logit_bytes) * tokens

    # ---- per stage ----------------------------------------------------------------------
    def memory(self, stage: Stage, par: Parallel, *, seq_len: int, micro_batch_tokens: int = 0,
               kv_tokens: int = 0) -> Memory:
        """Peak bytes per device of `stage` in layout `par`.

        Args:
            seq_len: the (longest) sequence length.
            micro_batch_tokens: tokens per micro-batch (train, reference); default `seq_len`.
            kv_tokens: tokens of KV cache held at once per replica (rollout); default `seq_len`.
        """
        c = self.config
        mb = max(micro_batch_tokens or seq_len, seq_len)
        w = self.weight_bytes(par)
        if stage == "rollout":
            kv = self.kv_bytes_per_token(par) * max(kv_tokens or seq_len, seq_len)
            return Memory(weights=w, kv_cache=kv, reserve=c.reserve_bytes)
        if stage == "reference":
            return Memory(weights=w, activations=self.forward_bytes(mb, seq_len, par),
                          reserve=c.reserve_bytes)
        p = self.shape.params / (par.tp * par.pp)
        return Memory(weights=w, grads=p * c.grad_bytes, optimizer=p * c.optimizer_bytes / par.dp,
                      activations=self.activation_bytes(mb, seq_len, par),
                      reserve=c.reserve_bytes)

    def max_micro_batch_tokens(self, stage: Stage, par: Parallel, seq_len: int,
                               capacity: float) -> int:
        """The largest micro-batch (tokens, a multiple of `seq_len`) that fits `capacity`
        bytes per device; 0 if not even one sequence fits. For rollout: KV tokens."""
        key = "kv_tokens" if stage == "rollout" else "micro_batch_tokens"
        if self.memory(stage, par, seq_len=seq_len, **{key: seq_len}).total > capacity:
            return 0
        lo, hi = 1, 2
        while self.memory(stage, par, seq_len=seq_len, **{key: hi * seq_len}).total <= capacity:
            lo, hi = hi, hi * 2
            if hi > 1 << 20:
                break
        while hi - lo > 1:
            mid = (lo + hi) // 2
            fits = self.memory(stage, par, seq_len=seq_len,
                               **{key: mid * seq_len}).total <= capacity
            lo, hi = (mid, hi) if fits else (lo, mid)
        return lo * seq_len

    # ---- throughput (roofline; profiles override) ---------------------------------------
    def tokens_per_s(self, stage: Stage, par: Parallel, seq_len: int, *, batch_tokens: int,
                     mfu: float = 0.4, step_tokens: int = 0, attention_len: float = 0.0,
                     kv_tokens: int = 0) -> float:
        """Tokens/s of the whole layout (all its devices) for one context length, on devices of
        `CostConfig.peak_flops` and `mem_bw`.

        Training and reference are compute bound (6 or 2 FLOPs per parameter per token plus
        attention) at `mfu`; a rollout decode step reads the weights and the KV cache of the
        `batch_tokens` resident tokens once and computes 2 FLOPs per parameter (plus attention)
        for each sequence: it takes the longer of the two (on a GPU the read, on a CPU core the
        compute from a few sequences on, where batching more sequences into one replica no
        longer amortizes anything), plus `CostConfig.decode_step_s`. Each doubling of TP costs
        `CostConfig.tp_overhead` of efficiency (communication), PP a bubble of (pp-1)/(micro-batches),
        where a DP replica's micro-batches are `step_tokens / (dp * batch_tokens)` (4 x pp when
        `step_tokens` is 0).

        Attention is priced at the tokens' positions: a token at position p attends to p
        others (causal), so a sequence of L tokens costs 4 x layers x hidden x L^2 / 2 FLOPs
        forward, `2 x layers x hidden x attention_len` per token of sequences whose
        token-weighted length (`token_weighted_length`) is `attention_len`; 0 prices every
        sequence at `seq_len` (all at the longest: an upper bound). Likewise a decode step
        reads `kv_tokens` of KV cache, its sequences at their current positions (0: all
        `batch_tokens`, at the longest). Memory is `memory`'s, at the longest.
        """
        s, c = self.shape, self.config
        eff = (1 - c.tp_overhead) ** (par.tp.bit_length() - 1)
        attn = 2 * s.layers * s.hidden * (attention_len or seq_len)
        if stage == "rollout":
            seqs = max(1, batch_tokens // seq_len)
            kv = kv_tokens or batch_tokens
            step_bytes = self.weight_bytes(par) + self.kv_bytes_per_token(par) * kv
            step_flops = seqs * 2 * (s.params + attn) / (par.tp * par.pp)
            step_s = max(step_bytes / c.mem_bw, step_flops / (c.peak_flops * mfu))
            return seqs / (step_s + c.decode_step_s) * eff * par.dp
        flops = (6 if stage == "train" else 2) * (s.params + attn)
        if stage == "train" and (par.recompute or c.recompute):
            flops = flops * 4 // 3  # one more forward
        micro = max(1, step_tokens // (par.dp * batch_tokens)) if step_tokens else 4 * par.pp
        bubble = micro / (micro + par.pp - 1)
        return par.devices * c.peak_flops * mfu * eff * bubble / flops


def token_weighted_length(lengths: Iterable[int]) -> float:
    """sum(L^2) / sum(L) of sequences of `lengths`: the length at which `tokens_per_s` prices
    their attention exactly (a token's average attended length, times two). Equals the length
    when all are alike, and lies below the longest otherwise.

    >>> token_weighted_length([1024, 1024])
    1024.0
    >>> token_weighted_length([1024, 3072])
    2560.0
    """
    ls = [int(n) for n in lengths]
    total = sum(ls)
    if total <= 0:
        raise ValueError("token_weighted_length: needs at least one sequence of > 0 tokens")
    return sum(n * n for n in ls) / total


def paper_points(model: CostModel | None = None) -> dict[int, float]:
    """GB per device the model gives at the EARL paper's two points (see module docstring)."""
    m = model or CostModel(ModelShape.llama31_70b(), CostConfig(attention="eager"))
    par = Parallel(tp=8)
    return {n: m.activation_bytes(n, n, par) / GB for n in (4096, 8192)}
