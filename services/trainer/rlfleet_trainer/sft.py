"""Supervised warm start on (prompt, answer) pairs of the arithmetic task.

The loss is the mean negative log-likelihood of the answer tokens and the EOS token that ends
them (the prompt is context only):

    loss = -sum_t mask_t * log p(token_t | tokens_<t) / sum_t mask_t
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlfleet.arithmetic import ArithmeticTask, Problem
from rlfleet_trainer.batch import TrainSequence, pack
from rlfleet_trainer.optim import LrSchedule, make_optimizer
from rlfleet_trainer.policy import load_policy, token_logprobs
from rlfleet_trainer.weights import write_model_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SftConfig:
    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 64
    """Problems per step."""
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    seed: int = 0
    """Seed of the data order and of torch."""
    log_every: int = 20
    """Log progress every this many steps."""


def sft_sequences(problems: list[Problem], tokenizer: PreTrainedTokenizerBase) -> list[TrainSequence]:
    out = []
    for problem in problems:
        prompt = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append(
            TrainSequence(
                tokens=(*prompt, *answer),
                prompt_len=len(prompt),
                old_logp=(0.0,) * len(answer),
                mask=(1,) * len(answer),
            )
        )
    return out


def sft_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logp, mask: (B, T) response grid -> scalar token-mean NLL over masked-in tokens."""
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def run_sft(model_path: Path, out_dir: Path, task: ArithmeticTask, config: SftConfig) -> Path:
    """Trains the model at `model_path` on train-split problems and writes it to `out_dir`."""
    if config.steps < 1 or config.batch_size < 1:
        raise ValueError("steps and batch_size must be >= 1")
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = load_policy(model_path)
    model.train()
    schedule = LrSchedule(warmup_steps=config.warmup_steps)
    optimizer, scheduler = make_optimizer(model, config.learning_rate, 0.0, schedule)
    pad_id = tokenizer.pad_token_id or 0
    started = time.perf_counter()
    for step in range(1, config.steps + 1):
        # A fresh draw of train problems per step (the task is procedural): no fixed pool to overfit.
        sequences = sft_sequences(task.problems("train", config.batch_size, epoch=step), tokenizer)
        # One sequence per row in draw order: problems are short and alike, so packing would save
        # little, and this order keeps the warm start's floating-point path (and its result) as it was.
        batch = pack(sequences, [[i] for i in range(len(sequences))], pad_id)
        loss = sft_loss(token_logprobs(model, batch, temperature=1.0).logp, batch.mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % config.log_every == 0 or step == config.steps:
            logger.info(
                "sft step %d/%d: loss %.4f (%.1f steps/s)",
                step,
                config.steps,
                float(loss.detach()),
                step / (time.perf_counter() - started),
            )
    return write_model_dir(model, Path(out_dir), Path(model_path))
