"""``benchmarks/embed.py``'s ``--products`` setting: ``QKV_CPU_PRODUCTS`` set within the block
of one contestant's compile only (the timings are measured only by running the script)."""

import importlib
import os
from pathlib import Path

import pytest

from qkv.models.cpu_products import ENV, mkl_reads_fast

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"

with pytest.MonkeyPatch.context() as _patch:  # sys.path and the environment as they were after
    _patch.syspath_prepend(str(BENCHMARKS))
    _patch.setenv("HF_HUB_OFFLINE", "1")  # what the script sets for itself on import
    embed_script = importlib.import_module("embed")
assert Path(embed_script.__file__ or "").parent == BENCHMARKS, embed_script


@pytest.mark.parametrize("before", [None, "mkl"])
def test_products_are_set_within_the_block_and_restored(
    monkeypatch: pytest.MonkeyPatch, before: str | None
) -> None:
    """Each setting is what ``mkl_reads_fast`` reads inside; the caller's value comes back."""
    if before is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, before)
    with embed_script.cpu_products("inductor"):
        assert os.environ[ENV] == "inductor" and not mkl_reads_fast()
    with embed_script.cpu_products("default"):
        assert ENV not in os.environ  # this CPU's own choice
    with pytest.raises(RuntimeError), embed_script.cpu_products("inductor"):
        raise RuntimeError("a failed compile")
    assert os.environ.get(ENV) == before


def test_unknown_products_are_refused() -> None:
    refused = pytest.raises(ValueError, match=r"products must be one of .*got 'onednn'")
    with refused, embed_script.cpu_products("onednn"):
        pass
