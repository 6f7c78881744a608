"""A task builds its model's config; the registry builds the model and names its type back; the
decoding options reach the model's ``generate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from qkv.models.registry import MODEL_TYPES, model_from_config, model_type_of
from qkv.train.config import TrainConfig
from qkv.train.inference import generate_text
from qkv.train.task import EOS_ID
from qkv.train.tasks import TextTask, build_task

FIXTURES = Path(__file__).parents[1] / "fixtures" / "qkv_0_1"


@pytest.mark.parametrize("name", ["reverse", "text"])
def test_tasks_build_the_model_config_qkv_0_1_wrote(name: str) -> None:
    manifest = json.loads((FIXTURES / name / "config.json").read_text())
    stored = dict(manifest["train_config"])
    if stored["text_path"] is not None:
        stored["text_path"] = str(FIXTURES / stored["text_path"])
    cfg = TrainConfig.from_dict(stored)
    task = build_task(cfg)
    assert task.model_type == manifest["model_type"]
    config_cls = MODEL_TYPES[task.model_type].config
    built = config_cls.from_dict(task.model_config(cfg))
    assert built == config_cls.from_dict(manifest["model_config"])


@pytest.mark.parametrize("name", ["reverse", "text"])
def test_registry_round_trip(name: str) -> None:
    manifest = json.loads((FIXTURES / name / "config.json").read_text())
    model = model_from_config(manifest["model_type"], manifest["model_config"])
    assert model_type_of(model) == manifest["model_type"]


def test_registry_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match=r"unknown model_type 'gpt'; expected one of"):
        model_from_config("gpt", {})
    with pytest.raises(TypeError, match="Linear is not a registered model type"):
        model_type_of(nn.Linear(2, 2))


def test_decoding_options_reach_the_text_model() -> None:
    task = TextTask(None, block_size=8, symbols="abcd")
    cfg = TrainConfig(task="text", d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    torch.manual_seed(0)
    model = model_from_config(task.model_type, task.model_config(cfg)).eval()
    gen = generate_text(
        model, task, "abc", max_new_tokens=5, temperature=0.7, top_k=2, greedy=False, seed=3
    )
    ids = task.vocab.encode("abc")
    with torch.no_grad():
        direct = model.generate(  # type: ignore[operator]
            torch.tensor([ids]),
            5,
            temperature=0.7,
            top_k=2,
            greedy=False,
            eos_id=EOS_ID,
            generator=torch.Generator().manual_seed(3),
        )  # [1, 3 + 5]
    assert gen.ids == direct[0, len(ids) :].tolist()
    with pytest.raises(ValueError, match="beam_size must be a positive int, got 0"):
        generate_text(model, task, "abc", beam_size=0)
    with pytest.raises(ValueError, match="beam search is for sequence tasks"):
        generate_text(model, task, "abc", beam_size=2)
