"""The training loop: it learns, it is reproducible bit for bit, and resume is exact."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.train.config import TrainConfig, lr_at
from qkv.train.loop import RunOptions, evaluate, loss_sum, train
from qkv.train.tasks import EOS_ID, PAD_ID, Seq2SeqTask, make_task

QUIET = RunOptions(progress=False, log_evals=False)


def _weights(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_bitwise_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_short_run_lowers_the_loss(tiny: Callable[..., TrainConfig]) -> None:
    result = train(tiny(lr=1e-2), QUIET)  # measured ratio last/first: 0.71
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert len(result.losses) == 30 and result.step == 30
    assert last < 0.8 * first, (first, last)
    assert result.evals and 0.0 <= result.evals[-1]["accuracy"] <= 1.0
    assert result.tokens_per_s > 0


def test_text_task_lowers_the_loss(tmp_path: Path, tiny: Callable[..., TrainConfig]) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 60, encoding="utf-8")
    cfg = tiny(task="text", text_path=str(corpus), block_size=16, lr=1e-2)
    result = train(cfg, QUIET)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.9 * first, (first, last)  # measured ratio: 0.85
    assert result.evals and 0.0 < result.evals[-1]["accuracy"] <= 1.0


def test_same_seed_is_bit_for_bit_reproducible(tiny: Callable[..., TrainConfig]) -> None:
    cfg = tiny(steps=10, dropout=0.1)
    a, b = train(cfg, QUIET), train(cfg, QUIET)
    assert a.losses == b.losses
    _assert_bitwise_equal(_weights(a.model), _weights(b.model))
    c = train(tiny(steps=10, dropout=0.1, seed=1), QUIET)
    assert c.losses != a.losses


def test_resume_reaches_the_same_weights(tmp_path: Path, tiny: Callable[..., TrainConfig]) -> None:
    # dropout > 0: the restored RNG state matters; eval at 6 falls inside the first leg
    cfg = tiny(steps=12, eval_every=6, dropout=0.1)
    whole = train(cfg, RunOptions(out=tmp_path / "whole", progress=False, log_evals=False))
    part = RunOptions(out=tmp_path / "split", stop_after=7, progress=False, log_evals=False)
    first = train(cfg, part)
    assert first.step == 7
    rest = RunOptions(out=tmp_path / "split", resume=True, progress=False, log_evals=False)
    second = train(cfg, rest)
    assert second.step == 12
    assert first.losses + second.losses == whole.losses
    _assert_bitwise_equal(_weights(whole.model), _weights(second.model))


def test_resume_refuses_a_different_config(
    tmp_path: Path, tiny: Callable[..., TrainConfig]
) -> None:
    opts = RunOptions(out=tmp_path, stop_after=2, progress=False, log_evals=False)
    train(tiny(steps=4), opts)
    with pytest.raises(ValueError, match=r"lr: checkpoint 0\.003, now 0\.001"):
        train(tiny(steps=4, lr=1e-3), RunOptions(out=tmp_path, resume=True, progress=False))
    with pytest.raises(ValueError, match=r"--resume.*--overwrite"):
        train(tiny(steps=4), RunOptions(out=tmp_path, progress=False))


def test_schedules() -> None:
    cfg = TrainConfig(lr=1.0, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert lr_at(10, cfg) == 1.0
    assert math.isclose(lr_at(60, cfg), 0.55)  # half way down the cosine
    assert math.isclose(lr_at(110, cfg), 0.1)
    inv = TrainConfig(lr=1.0, warmup_steps=16, schedule="inverse_sqrt")
    assert math.isclose(lr_at(63, inv), 0.5)
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="linear")


def test_label_smoothed_loss_matches_its_formula() -> None:
    task = make_task("reverse", max_len=4)
    batch = task.train_batch(0, 0, 6)
    V = task.vocab.size
    logits = torch.randn(*batch.tgt_out.shape, V, dtype=torch.float64)

    class Fixed(nn.Module):
        def forward(self, src: Tensor, tgt: Tensor, **_: object) -> Tensor:
            return logits

    eps = 0.1
    total, n = loss_sum(Fixed(), batch, label_smoothing=eps)
    logp = logits.log_softmax(-1)
    keep = batch.tgt_out != PAD_ID
    nll = -logp.gather(-1, batch.tgt_out.unsqueeze(-1)).squeeze(-1)
    expected = ((1 - eps) * nll + eps * (-logp.mean(-1)))[keep].sum()
    assert n == int(keep.sum())
    torch.testing.assert_close(total, expected)
    plain, _ = loss_sum(Fixed(), batch)
    torch.testing.assert_close(plain, F.nll_loss(logp[keep], batch.tgt_out[keep], reduction="sum"))


class _Oracle(nn.Module):
    """Answers by looking up the task's target: the exact-match metric must give 1 (or 0)."""

    def __init__(self, task: Seq2SeqTask, emit_eos: bool) -> None:
        super().__init__()
        self.task, self.emit_eos = task, emit_eos

    def forward(self, src: Tensor, tgt: Tensor, **_: object) -> Tensor:
        return torch.zeros(*tgt.shape, self.task.vocab.size)

    def generate(self, src: Tensor, max_new_tokens: int, **_: object) -> Tensor:
        rows = []
        for ids in src.tolist():
            out = self.task.vocab.encode(self.task.target(self.task.vocab.decode(ids)))
            rows.append([1, *out, *([EOS_ID] if self.emit_eos else [3])])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows])


@pytest.mark.parametrize(("emit_eos", "expected"), [(True, 1.0), (False, 0.0)])
def test_exact_match_needs_the_whole_sequence_and_eos(
    emit_eos: bool, expected: float, tiny: Callable[..., TrainConfig]
) -> None:
    cfg = tiny(task="add", eval_size=50)
    task = make_task("add")
    assert isinstance(task, Seq2SeqTask)
    acc, loss = evaluate(_Oracle(task, emit_eos), task, cfg)
    assert acc == expected
    assert math.isclose(loss, math.log(task.vocab.size), rel_tol=1e-6)


def test_progress_into_a_log_is_a_line_per_evaluation(
    tiny: Callable[..., TrainConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27: with stderr not a terminal (``make demo > log 2>&1``) the bar's carriage-return
    redraws filled the log (278 kB for the demo); now there is one line per evaluation."""
    train(tiny(steps=6, eval_every=3, eval_size=4), RunOptions(progress=True, log_evals=False))
    captured = capsys.readouterr()  # pytest's capture: not a terminal
    assert "\r" not in captured.err + captured.out
    lines = captured.out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 3", "step 6"]
    assert all("train loss" in line and "tokens/s" in line for line in lines)
