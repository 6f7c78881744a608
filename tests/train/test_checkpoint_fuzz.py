"""Every malformed ``config.json`` gives one :class:`CheckpointError`, never a raw ``KeyError``,
``OverflowError`` or ``RecursionError``: a seeded fuzz of a real checkpoint's manifest.

CI runs a few dozen cases; the long run is ``python tests/train/test_checkpoint_fuzz.py --cases
5000``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qkv.train.checkpoint import CheckpointError, restore_optimizer
from qkv.train.config import TrainConfig, build_optimizer
from qkv.train.inference import load_trained
from qkv.train.loop import RunOptions, train

_RAW = "\x00raw\x00"  # a string value replaced by raw JSON text after dumping
_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    2.5,
    10**30,
    "x",
    "../../etc/passwd",
    [],
    {},
    [1, [2]],
    {"a": {"b": None}},
    float("nan"),
    _RAW + "1e400",
    _RAW + "-1e400",
    _RAW + "[" * 100_000 + "]" * 100_000,
]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _mutated(manifest: dict[str, Any], rng: random.Random) -> str:
    """One to three random edits (replace or delete a value at a random path), as JSON text."""
    doc = json.loads(json.dumps(manifest))
    for _ in range(rng.randint(1, 3)):
        paths = _paths(doc)
        if not paths:
            break
        path = rng.choice(paths)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if rng.random() < 0.25 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = rng.choice(_VALUES)
    text = json.dumps(doc)
    for value in _VALUES:
        if isinstance(value, str) and value.startswith(_RAW):
            text = text.replace(json.dumps(value), value[len(_RAW) :])
    if rng.random() < 0.1:
        text = text[: rng.randrange(len(text))]  # truncated
    return text


def fuzz(checkpoint: Path, cases: int, seed: int = 0) -> dict[str, int]:
    """Load ``cases`` mutations of ``checkpoint``'s manifest (and resume its optimizer).

    Returns:
        How many cases loaded and how many raised :class:`CheckpointError`.

    Raises:
        AssertionError: any other exception, with the case's seed and text.
    """
    manifest = json.loads((checkpoint / "config.json").read_text())
    cfg = TrainConfig.from_dict(manifest["train_config"])
    counts = {"loaded": 0, "CheckpointError": 0}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "ckpt"
        shutil.copytree(checkpoint, work)
        for case in range(cases):
            rng = random.Random(f"{seed}-{case}")
            text = _mutated(manifest, rng)
            (work / "config.json").write_text(text)
            try:
                model, _, ckpt = load_trained(work)
                restore_optimizer(build_optimizer(model, cfg), ckpt)
                counts["loaded"] += 1
            except CheckpointError:
                counts["CheckpointError"] += 1
            except Exception as err:
                raise AssertionError(
                    f"case {case} (seed {seed}) raised {type(err).__name__}: {err!s:.300}\n"
                    f"manifest: {text[:600]}"
                ) from err
    return counts


def _checkpoint(directory: Path, cfg: TrainConfig) -> Path:
    train(cfg, RunOptions(out=directory, progress=False, log_evals=False))
    return directory


def test_every_malformed_manifest_is_one_checkpoint_error(
    tmp_path: Path, tiny: Callable[..., TrainConfig]
) -> None:
    checkpoint = _checkpoint(tmp_path / "run", tiny(steps=2, eval_every=2, eval_size=4))
    counts = fuzz(checkpoint, cases=60)
    assert counts["CheckpointError"] > 30, counts  # most mutations break the manifest


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('"step": 1e400', "step must be a non-negative int"),
        ('"step": -3', "step must be a non-negative int"),
        ('"files": {}', "files must name the weights"),
        ('"model_type": "gpt"', "unknown model_type"),
        ('"model_config": ' + "[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ],
)
def test_named_malformations(
    tmp_path: Path, tiny: Callable[..., TrainConfig], text: str, expected: str
) -> None:
    checkpoint = _checkpoint(tmp_path / "run", tiny(steps=2, eval_every=2, eval_size=4))
    manifest = json.loads((checkpoint / "config.json").read_text())
    key = text.split('"')[1]
    manifest[key] = "\x00sentinel\x00"
    body = json.dumps(manifest).replace(f'"{key}": "\\u0000sentinel\\u0000"', text)
    (checkpoint / "config.json").write_text(body)
    with pytest.raises(CheckpointError, match=expected):
        load_trained(checkpoint)


def main() -> None:
    """``--cases N [--seed S]``: the long run, on a freshly trained tiny checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tiny = TrainConfig(
        max_len=5, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32, steps=2
    )
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = _checkpoint(Path(tmp) / "run", tiny)
        print(fuzz(checkpoint, args.cases, args.seed))


if __name__ == "__main__":
    main()
