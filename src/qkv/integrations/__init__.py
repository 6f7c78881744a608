"""qkv inside other libraries: :mod:`qkv.integrations.transformers` registers qkv's attention
as ``attn_implementation="qkv"`` in Hugging Face ``transformers``."""
