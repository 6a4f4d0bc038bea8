"""The supervised warm start as a short-lived actor: from a random model to a random *legal* player.

`Learner` loads the HF model in its own process and minimises cross-entropy towards the uniform
distribution over each turn's legal moves (soft targets), then writes the weights as an HF
folder (tokenizer included) that the RL trainer (`earl.stages.trainer.TrainerActor`), the
reference and the rollout actors start from. With LoRA (`earl.stages.lora`) it trains adapters
and writes the merged weights; with bf16 it computes under autocast over fp32 weights. It is not
the RL trainer and it never sees rewards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from earl.packing import pack, packed_forward, set_attention
from earl.packing_prefix import share_prefixes, shared_forward
from earl.runtime import Actor, endpoint
from earl.stages.lora import LoraConfig, apply_lora, base_model, merged_weights


class Learner(Actor):
    """Warm-start trainer in one process.

    Args:
        model_path: HF folder to start from (its tokenizer files are copied on save).
        seed: torch seed of this process.
        threads: torch threads.
        lora: train low-rank adapters (rank > 0) instead of every weight.
        dtype: "float32", or "bfloat16" (autocast; the weights stay fp32).
        shared_prefix: run the leading tokens that a step's transcripts agree on (a system
            prompt) once per forward (`earl.packing_prefix`).
    """

    def __init__(self, model_path: str, *, seed: int = 0, threads: int = 1,
                 lora: LoraConfig | None = None, dtype: str = "float32",
                 shared_prefix: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Learner dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model_path = model_path
        self.dtype = dtype
        self.shared_prefix = shared_prefix
        self.model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32)
        set_attention(self.model, "varlen")
        self._tied = set(getattr(self.model, "all_tied_weights_keys", {}) or {})
        self.lora = lora is not None and lora.on
        if self.lora:
            assert lora is not None
            self.model = apply_lora(self.model, lora)
        self.model.train()

    @endpoint
    async def warm_start(self, input_ids: list[np.ndarray], targets: list[np.ndarray],
                         steps: int, batch_size: int, lr: float) -> list[float]:
        """Supervised warm start; `targets[i]` is `[L_i, V]`-free: rows of (pos, token, weight).

        Each target row says: at position `pos` (the token being predicted), put probability
        `weight` on `token`. Rows of one position sum to 1 (uniform over legal moves, or 1 on
        the closing token). Returns the loss every 25 steps.
        """
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                weight_decay=0.0)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.dtype == "bfloat16" \
            else contextlib.nullcontext()
        gen = torch.Generator().manual_seed(1234)
        losses: list[float] = []
        n = len(input_ids)
        for step in range(steps):
            idx = torch.randint(0, n, (min(batch_size, n),), generator=gen).tolist()
            packed = pack([torch.from_numpy(input_ids[i]) for i in idx])
            rows, cols, ws = [], [], []
            for j, i in enumerate(idx):
                t = targets[i]
                base = int(packed.cu_seqlens[j])
                rows.append(base + t[:, 0].astype(np.int64) - 1)  # logits at pos-1 predict pos
                cols.append(t[:, 1].astype(np.int64))
                ws.append(t[:, 2].astype(np.float32))
            r = torch.from_numpy(np.concatenate(rows))
            c = torch.from_numpy(np.concatenate(cols))
            w = torch.from_numpy(np.concatenate(ws))
            keep, r = torch.unique(r, return_inverse=True)  # the LM head runs on these rows only
            with autocast:
                if self.shared_prefix:
                    trained = torch.zeros(packed.input_ids.numel())
                    trained[keep + 1] = 1.0
                    sp = share_prefixes(packed, trained)
                    logits = shared_forward(self.model, sp, keep)
                else:
                    logits = packed_forward(self.model, packed, keep)
            logp = torch.log_softmax(logits.float(), -1)
            loss = -(logp[r, c] * w).sum() / w.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 25 == 0 or step == steps - 1:
                losses.append(loss.item())
        return losses

    @endpoint
    async def save_weights(self, path: str) -> str:
        """Write the current weights as an HF folder (atomically replaced)."""
        tmp = Path(path + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        if self.lora:  # the merged weights as a plain checkpoint (no adapter files)
            state = {n: t.contiguous() for n, t in merged_weights(self.model)
                     if n not in self._tied}
            base_model(self.model).save_pretrained(tmp, state_dict=state)  # type: ignore[operator]
        else:
            self.model.save_pretrained(tmp)  # type: ignore[operator]
        for f in Path(self.model_path).iterdir():  # a self-contained HF folder
            if f.is_file() and ("token" in f.name or f.name.endswith((".jinja", ".txt"))):
                shutil.copy(f, tmp / f.name)
        final = Path(path)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return str(final)
