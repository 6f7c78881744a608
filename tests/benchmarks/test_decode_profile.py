"""``benchmarks/decode_profile.py``'s reading of an ``MKL_VERBOSE`` log (the part of the script
that computes; the timings it reads are measured only by running it)."""

import importlib
import math
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def _script() -> ModuleType:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # its sibling decode.py, as when run as a script
        module = importlib.import_module("decode_profile")
    assert Path(module.__file__ or "").parent == BENCHMARKS, module
    return module


products = _script().products


def _call(name: str, args: str, time: str) -> str:
    tail = "0x7f,768,0x7f,768,0x7f,0x7f,2304"
    return f"MKL_VERBOSE {name}({args},{tail}) {time} CNR:OFF Dyn:0 NThr:2\n"


def test_products_add_one_steps_weight_calls() -> None:
    """Two steps of 3 layers (two one-row products each) and the output head; a 16-row prompt,
    a weight packing, attention's products and a slow outlier do not count."""
    log = _call("SGEMM", "N,N,2304,16,768", "900.00us")  # the prompt: 16 rows
    for step in range(2):
        log += _call("SGEMM_PACK", "A,T,2304,1,768", "5.00ms")  # packing, not a product
        for layer in range(3):
            slow = step == 1 and layer == 2
            log += _call("SGEMM", "N,N,2304,1,768", "950.00us" if slow else "200.00us")
            log += _call("SGEMM_COMPUTE", "P,N,768,1,3072", "0.3ms")
            log += _call("SGEMM_BATCH_STRIDED", "T,N,20,1,64", "10.00us")  # attention
            log += _call("SGEMM", "T,N,20,1,64", "10.00us")  # attention-sized
        log += _call("SGEMM", "N,N,50257,1,768", "4.00ms")  # the head, once a step
    assert products(log, 768, steps=2) == pytest.approx(3 * (0.2 + 0.3) + 4.0)


def test_a_log_without_products_gives_nan() -> None:
    assert math.isnan(products("nothing from MKL\n", 768, steps=2))


def test_the_prefills_head_alone_is_not_a_steps_product() -> None:
    """Off Intel the steps multiply outside MKL, and only the prefill's one-row output head
    (one per generation) appears in the log: that is no step's product."""
    log = ""
    for _ in range(3):  # three generations of 8 steps
        log += _call("SGEMM", "N,N,2304,16,768", "900.00us")  # the prompt: 16 rows
        log += _call("SGEMM", "T,N,50257,1,768", "11.00ms")  # the prompt's last row: the head
    assert math.isnan(products(log, 768, steps=24))
