"""State-dict conversion to and from other implementations (``torch.nn``, Hugging Face)."""

from qkv.convert.bert import load_bert
from qkv.convert.torch_mha import from_torch_mha, to_torch_mha

__all__ = ["from_torch_mha", "load_bert", "to_torch_mha"]
