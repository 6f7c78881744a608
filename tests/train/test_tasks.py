"""Built-in tasks: correct targets, disjoint splits, determinism, padding."""

from __future__ import annotations

import random

import pytest

from qkv.train.tasks import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    AddTask,
    TextTask,
    Vocab,
    is_held_out,
    make_task,
    task_from_spec,
)


@pytest.mark.parametrize(
    ("name", "source", "target"),
    [("copy", "abca", "abca"), ("reverse", "abcd", "dcba"), ("sort", "dbca", "abcd")],
)
def test_alphabet_targets(name: str, source: str, target: str) -> None:
    assert make_task(name).target(source) == target


def test_add_targets_are_sums() -> None:
    task = AddTask(max_digits=3)
    rng = random.Random(0)
    for _ in range(300):
        src = task.sample_source(rng)
        a, b = src[:-1].split("+")
        assert src.endswith("=")
        assert task.target(src) == str(int(a) + int(b))
        assert 1 <= len(a) <= 3 and 1 <= len(b) <= 3
    assert task.target("123+45=") == "168"
    with pytest.raises(ValueError, match="123-45"):
        task.target("123-45=")


def test_batches_match_their_targets_and_pad() -> None:
    task = make_task("reverse", min_len=1, max_len=6)
    batch = task.train_batch(seed=3, step=7, batch_size=32)
    vocab = task.vocab
    lengths = set()
    for src, tin, tout in zip(
        batch.src.tolist(), batch.tgt_in.tolist(), batch.tgt_out.tolist(), strict=True
    ):
        s = vocab.decode(src)
        lengths.add(len(s))
        assert tin[0] == BOS_ID
        assert vocab.decode(tin) == s[::-1]
        n = len(s)
        assert tout[n] == EOS_ID and tout[:n] == tin[1 : n + 1]
        assert all(t == PAD_ID for t in tout[n + 1 :])
    assert len(lengths) > 1, "variable lengths, so padding is exercised"


def test_batches_are_a_function_of_seed_and_step() -> None:
    task = make_task("add")
    a, b = task.train_batch(1, 5, 16), task.train_batch(1, 5, 16)
    assert a.src.equal(b.src) and a.tgt_out.equal(b.tgt_out)
    assert not task.train_batch(1, 6, 16).src.equal(a.src)
    assert not task.train_batch(2, 5, 16).src.equal(a.src)


@pytest.mark.parametrize("name", ["copy", "reverse", "sort", "add"])
def test_held_out_split_is_disjoint_from_training(name: str) -> None:
    task = make_task(name, max_len=5, max_digits=2)
    held = set(task.eval_sources(200, seed=0))
    assert len(held) == 200
    assert all(is_held_out(s, task.held_out_fraction) for s in held)
    vocab = task.vocab
    for step in range(30):
        batch = task.train_batch(seed=0, step=step, batch_size=64)
        train = {vocab.decode(row) for row in batch.src.tolist()}
        assert not train & held


def test_shards_partition_the_global_batch() -> None:
    batch = make_task("copy").train_batch(0, 0, 8)
    parts = [batch.shard(r, 2) for r in range(2)]
    assert parts[0].src.shape[0] == parts[1].src.shape[0] == 4
    assert parts[0].src.equal(batch.src[:4]) and parts[1].src.equal(batch.src[4:])
    with pytest.raises(ValueError, match="world_size=3"):
        batch.shard(0, 3)


def test_text_task_splits_by_position_and_round_trips() -> None:
    text = "".join(random.Random(0).choice("abcde \n") for _ in range(2000))
    task = TextTask(text, block_size=16)
    assert task.train_text + task.eval_text == text
    batch = task.train_batch(0, 0, 8)
    assert batch.inputs.shape == batch.targets.shape
    row_in, row_t = batch.inputs[0].tolist(), batch.targets[0].tolist()
    n = sum(t != PAD_ID for t in row_t)
    assert row_in[1:n] == row_t[: n - 1], "targets are the inputs shifted by one"
    again = task_from_spec(task.spec())
    assert again.vocab == task.vocab


def test_vocab_errors_name_the_character() -> None:
    vocab = Vocab(tuple("ab"))
    assert vocab.size == 5 and vocab.decode([*vocab.encode("ba"), EOS_ID, 3]) == "ba"
    with pytest.raises(ValueError, match="'z' at position 1"):
        vocab.encode("az")
    with pytest.raises(ValueError, match="unique"):
        Vocab(tuple("aa"))


def test_make_task_errors() -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match="--text FILE"):
        make_task("text")
    with pytest.raises(ValueError, match="min_len"):
        make_task("copy", min_len=5, max_len=2)
