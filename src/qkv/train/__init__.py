"""Training, checkpoints and decoding: the :class:`~qkv.train.task.Task` protocol and the
built-in tasks, the loop, safetensors checkpoints, multi-process data and context parallelism. The
``qkv train/generate/plot`` commands (:mod:`qkv.apps`) call into here."""

from qkv.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from qkv.train.config import TrainConfig
from qkv.train.inference import generate_text, load_trained
from qkv.train.loop import RunOptions, TrainResult, train
from qkv.train.task import Batch, DecodeOptions, EvalSums, Task
from qkv.train.tasks import make_task

__all__ = [
    "Batch",
    "CheckpointError",
    "DecodeOptions",
    "EvalSums",
    "RunOptions",
    "Task",
    "TrainConfig",
    "TrainResult",
    "generate_text",
    "load_checkpoint",
    "load_trained",
    "make_task",
    "save_checkpoint",
    "train",
]
