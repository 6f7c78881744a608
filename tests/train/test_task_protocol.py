"""The Task protocol: a task written here, unknown to qkv, trains through the unchanged loop,
is evaluated under its own metric and decodes through ``generate_text``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from qkv.models.config import DecoderOnlyConfig
from qkv.models.registry import model_from_config
from qkv.train.config import TrainConfig
from qkv.train.inference import generate_text
from qkv.train.loop import RunOptions, evaluate, train
from qkv.train.task import (
    EOS_ID,
    PAD_ID,
    SPECIALS,
    DecodeOptions,
    EvalSums,
    Task,
    Vocab,
    loss_sum,
    pad_rows,
    step_rng,
)


@dataclass(frozen=True)
class _SuccessorBatch:
    """Its own batch class: ``targets[b, t]`` is the letter after ``inputs[b, t]``."""

    inputs: Tensor  # [B, T]
    targets: Tensor  # [B, T]

    @property
    def num_tokens(self) -> int:
        return int((self.targets != PAD_ID).sum())

    def logits(self, model: nn.Module) -> Tensor:
        return model(self.inputs, padding_mask=self.inputs == PAD_ID)

    def shard(self, rank: int, world_size: int) -> _SuccessorBatch:
        per = self.inputs.shape[0] // world_size
        rows = slice(rank * per, (rank + 1) * per)
        return _SuccessorBatch(self.inputs[rows], self.targets[rows])


class SuccessorTask:
    """Predict, at every position, the next letter of the alphabet (``a -> b``, ``e -> a``)."""

    name = "successor"
    model_type = "decoder_only"
    metric = "successor accuracy"

    def __init__(self) -> None:
        self.vocab = Vocab(tuple("abcde"))

    def spec(self) -> dict[str, Any]:
        return {"name": self.name}

    def model_config(self, cfg: TrainConfig) -> dict[str, Any]:
        return DecoderOnlyConfig(
            vocab_size=self.vocab.size,
            d_model=cfg.d_model,
            num_heads=cfg.num_heads,
            num_layers=cfg.num_layers,
            dim_feedforward=cfg.dim_feedforward,
            dropout=0.0,
            max_positions=16,
            pad_id=PAD_ID,
        ).to_dict()

    def _batch(self, seed: int, step: int, what: str, n: int) -> _SuccessorBatch:
        rng = step_rng(seed, step, what)
        first, k = len(SPECIALS), len(self.vocab.symbols)
        rows = [[first + rng.randrange(k) for _ in range(rng.randint(2, 8))] for _ in range(n)]
        succ = [[first + (i - first + 1) % k for i in row] for row in rows]
        return _SuccessorBatch(pad_rows(rows), pad_rows(succ))

    def train_batch(self, seed: int, step: int, batch_size: int) -> _SuccessorBatch:
        return self._batch(seed, step, "train", batch_size)

    @torch.no_grad()
    def held_out_sums(
        self, model: nn.Module, n: int, seed: int, rank: int, world_size: int
    ) -> EvalSums:
        batch = self._batch(seed, 0, "eval", n).shard(rank, world_size)
        total, tokens = loss_sum(model, batch)
        keep = batch.targets != PAD_ID  # [B, T]
        correct = int((batch.logits(model).argmax(-1) == batch.targets)[keep].sum())
        return EvalSums(correct=correct, count=tokens, loss=float(total), tokens=tokens)

    def generate(self, model: nn.Module, ids: list[int], options: DecodeOptions) -> list[int]:
        n = 3 if options.max_new_tokens is None else options.max_new_tokens
        out = model.generate(torch.tensor([ids]), n, eos_id=EOS_ID)  # type: ignore[operator]
        return list(out[0, len(ids) :].tolist())  # [n]

    def teacher_forced_ids(self, text: str, generated: list[int]) -> tuple[None, list[int]]:
        return None, self.vocab.encode(text) + generated


def test_a_custom_task_trains_one_step_through_the_loop(
    tiny: Callable[..., TrainConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny(steps=1, eval_every=1, eval_size=8, batch_size=4)
    task: Task = SuccessorTask()
    result = train(cfg, RunOptions(progress=False, log_evals=True), task=task)
    assert result.step == 1 and len(result.losses) == 1
    assert "held-out successor accuracy" in capsys.readouterr().out

    # The one step the loop took, redone by hand from the same seed: the same loss.
    torch.manual_seed(cfg.seed)
    fresh = model_from_config(task.model_type, task.model_config(cfg))
    batch = task.train_batch(cfg.seed, 0, cfg.batch_size)
    total, n = loss_sum(fresh, batch)
    torch.testing.assert_close(torch.tensor(result.losses[0]), total.detach() / n)
    changed = [
        k for k, v in fresh.state_dict().items() if not torch.equal(v, result.model.state_dict()[k])
    ]
    assert changed, "the optimizer step changed no weight"

    acc, loss = evaluate(result.model, task, cfg)
    assert result.evals[-1]["accuracy"] == acc and result.evals[-1]["loss"] == loss
    gen = generate_text(result.model, task, "abc", max_new_tokens=2)
    assert len(gen.ids) <= 2 and set(gen.text) <= set("abcde")
