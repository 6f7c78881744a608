"""What a person runs: the ``qkv`` command line (all argparse lives in :mod:`qkv.apps.cli`), the
demo, shape tracing, sentence embeddings, plots and the attention benchmark."""
