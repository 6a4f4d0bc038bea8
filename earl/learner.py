"""The pipeline's policy learner as an actor: warm start, one RL step per batch, weight export.

`Learner` owns the trainable HF model and its AdamW optimizer in its own process. It runs the
supervised warm start (cross-entropy towards a *random legal* move: the uniform distribution over
the legal digits of each turn), then one policy-gradient step per batch of trajectories using the
pure functions of `earl.algorithms` (PPO-clip, entropy bonus, KL to a frozen reference) over
padding-free packed sequences (`earl.packing`). After each step it writes the weights as an HF
folder that rollout actors reload in place. It also saves and restores full checkpoints (model,
optimizer, RNG, policy version).

It does not sample, compute advantages (the pipeline does) or talk to the dock.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

from earl.algorithms.objective import LossConfig, policy_objective
from earl.packing import pack, packed_forward, set_attention, token_entropy, token_logprobs
from earl.runtime import Actor, endpoint


class Learner(Actor):
    """Trainable policy in one process.

    Args:
        model_path: HF folder to start from.
        loss: LossConfig fields (dict: spawn arguments travel as plain data).
        lr: RL learning rate; warm start uses its own.
        max_grad_norm: gradient clipping.
        seed: torch seed of this process.
        threads: torch threads.
        reference: keep a frozen copy of the starting policy for the KL term.
    """

    def __init__(self, model_path: str, loss: dict[str, object], *, lr: float = 1e-3,
                 max_grad_norm: float = 1.0, seed: int = 0, threads: int = 1,
                 reference: bool = False) -> None:
        from transformers import (
            AutoModelForCausalLM,
            Qwen2ForCausalLM,  # noqa: F401 - fail early if missing
        )

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        set_attention(self.model, "varlen")
        self.model.train()
        self.loss_cfg = LossConfig(**loss)  # type: ignore[arg-type]
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99),
                                     weight_decay=0.0)
        self.version = 0
        self.reference: torch.nn.Module | None = None
        self.want_reference = reference

    def _set_reference(self) -> None:
        import copy

        self.reference = copy.deepcopy(self.model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)

    @endpoint
    async def warm_start(self, input_ids: list[np.ndarray], targets: list[np.ndarray],
                         steps: int, batch_size: int, lr: float) -> list[float]:
        """Supervised warm start; `targets[i]` is `[L_i, V]`-free: rows of (pos, token, weight).

        Each target row says: at position `pos` (the token being predicted), put probability
        `weight` on `token`. Rows of one position sum to 1 (uniform over legal moves, or 1 on
        the closing token). Returns the loss every 25 steps.
        """
        opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1234)
        losses: list[float] = []
        n = len(input_ids)
        for step in range(steps):
            idx = torch.randint(0, n, (min(batch_size, n),), generator=gen).tolist()
            packed = pack([torch.from_numpy(input_ids[i]) for i in idx])
            logits = packed_forward(self.model, packed).float()
            logp = torch.log_softmax(logits, -1)
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
            loss = -(logp[r, c] * w).sum() / w.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 25 == 0 or step == steps - 1:
                losses.append(float(loss))
        if self.want_reference:
            self._set_reference()
        return losses

    @endpoint
    async def train_step(self, input_ids: list[np.ndarray], loss_mask: list[np.ndarray],
                         advantages: list[np.ndarray],
                         rollout_logprobs: list[np.ndarray]) -> dict[str, float]:
        """One optimizer step on a batch of whole trajectories; returns scalar metrics."""
        if self.want_reference and self.reference is None:
            self._set_reference()
        packed = pack([torch.from_numpy(x) for x in input_ids])
        mask = torch.from_numpy(np.concatenate(loss_mask)).float()
        adv = torch.from_numpy(np.concatenate(advantages)).float()
        old = torch.from_numpy(np.concatenate(rollout_logprobs)).float()
        logits = packed_forward(self.model, packed)
        logp = token_logprobs(logits, packed)
        ent = token_entropy(logits, packed) if self.loss_cfg.entropy_coef > 0 else None
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(packed_forward(self.reference, packed), packed)
        loss, metrics = policy_objective(self.loss_cfg, logprobs=logp, advantages=adv,
                                         mask=mask, seq_ids=packed.seq_ids, old_logprobs=old,
                                         ref_logprobs=ref, entropy=ent)
        self.opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.version += 1
        out = {k: float(v) for k, v in metrics.items()}
        out["grad_norm"] = float(gn)
        out["tokens"] = float(packed.input_ids.numel())
        if ent is None:
            with torch.no_grad():
                ent_all = token_entropy(logits.detach(), packed)
                out["entropy"] = float((ent_all * mask).sum() / mask.sum().clamp(min=1))
        return out

    @endpoint
    async def save_weights(self, path: str) -> str:
        """Write the current weights as an HF folder (atomically replaced)."""
        tmp = Path(path + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        self.model.save_pretrained(tmp)
        for f in Path(self.model_path).glob("tokenizer*"):  # a self-contained HF folder
            shutil.copy(f, tmp / f.name)
        final = Path(path)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return str(final)

    @endpoint
    async def policy_version(self) -> int:
        return self.version

    @endpoint
    async def save_checkpoint(self, path: str) -> str:
        """Model, optimizer, RNG and version to one file (written atomically)."""
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                 "rng": torch.get_rng_state(), "version": self.version,
                 "reference": None if self.reference is None else self.reference.state_dict()}
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"])
        self.version = int(state["version"])
        if state.get("reference") is not None:
            self._set_reference()
            assert self.reference is not None
            self.reference.load_state_dict(state["reference"])
        return self.version
