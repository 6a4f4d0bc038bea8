"""Saved policies of `bench/race_chain.py` as Hugging Face model folders, for one evaluator.

- EARL's: a trainer checkpoint of a run (`<run>/checkpoint/step-N/trainer`, torch distributed
  checkpoint of model and optimizer) loaded into a `TorchTrainer` built from the run's own
  `config.json`, on the run's start weights (`<run>/weights_start`), and written with its
  `save_hf` (LoRA merged), exactly what EARL's rollout would serve at that step.
- TRL's: a peft adapter snapshot merged into the start weights TRL's warm start wrote.

Not here: choosing which snapshot stands for a point (`_race_measure.policy_at`), or
evaluating (`earl eval`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["earl_to_hf", "trl_to_hf"]


def earl_to_hf(run: Path, trainer_ckpt: Path, out: Path) -> Path:
    """The policy of EARL run `run` at checkpoint folder `trainer_ckpt`, as an HF folder."""
    from earl.config import RunConfig
    from earl.config_parse import from_dict
    from earl.loop.stage_configs import trainer_config
    from earl.stages.trainer_torch import TorchTrainer

    cfg = from_dict(RunConfig, json.loads((run / "config.json").read_text()))
    trainer = TorchTrainer(trainer_config(cfg, model=str(run / "weights_start")))
    trainer.load_checkpoint(trainer_ckpt)
    trainer.save_hf(out)
    return out


def trl_to_hf(start: Path, adapter: Path, out: Path) -> Path:
    """TRL's policy: adapter snapshot `adapter` merged into `start`, as an HF folder."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(out)
    for f in start.iterdir():  # tokenizer and chat template, as the start folder has them
        if f.is_file() and ("token" in f.name or f.name.endswith((".jinja", ".txt"))):
            shutil.copy2(f, out / f.name)
    return out
