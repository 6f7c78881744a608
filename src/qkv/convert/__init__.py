"""State-dict conversion to and from other implementations (``torch.nn``, Hugging Face)."""

from qkv.convert.hf_bert import load_bert
from qkv.convert.hf_load import load_hf
from qkv.convert.hf_save import save_hf
from qkv.convert.torch_mha import accept_qkv_state_dict, from_torch_mha, to_torch_mha
from qkv.convert.torch_transformer import (
    from_torch_decoder_layer,
    from_torch_encoder_layer,
    from_torch_transformer,
    to_torch_decoder_layer,
    to_torch_encoder_layer,
    to_torch_transformer,
)

__all__ = [
    "accept_qkv_state_dict",
    "from_torch_decoder_layer",
    "from_torch_encoder_layer",
    "from_torch_mha",
    "from_torch_transformer",
    "load_bert",
    "load_hf",
    "save_hf",
    "to_torch_decoder_layer",
    "to_torch_encoder_layer",
    "to_torch_mha",
    "to_torch_transformer",
]
