"""The supervised warm start as a short-lived actor: from a random model to a random *legal* player.

`Learner` loads the HF model in its own process and minimises cross-entropy towards the uniform
distribution over each turn's legal moves (soft targets), then writes the weights as an HF
folder (tokenizer included) that the RL trainer (`earl.stages.trainer.TrainerActor`), the
reference and the rollout actors start from. It is not the RL trainer and it never sees rewards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

from earl.packing import pack, packed_forward, set_attention
from earl.runtime import Actor, endpoint


class Learner(Actor):
    """Warm-start trainer in one process.

    Args:
        model_path: HF folder to start from (its tokenizer files are copied on save).
        seed: torch seed of this process.
        threads: torch threads.
    """

    def __init__(self, model_path: str, *, seed: int = 0, threads: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        set_attention(self.model, "varlen")
        self.model.train()

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
                losses.append(loss.item())
        return losses

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
