"""``qkv doctor DIR --text ...`` on a saved tiny Llama with a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import hf_models as hm
import pytest
from test_watch_hf import drops_mask
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AttentionInterface, PreTrainedTokenizerFast
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from qkv.apps.cli import main

WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(path)
    model = hm.build("llama", "sdpa")
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    return path


def test_a_clean_model_prints_the_table_and_exits_0(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["doctor", str(llama_dir), "--text", "w1 w2 w3 w4 w5", "--text", "w7 w8"])
    out = capsys.readouterr().out
    assert code == 0, out
    # 2 layers x (prefill + cached step) x (left + right padding)
    assert out.startswith("qkv doctor: 8 attention calls, no findings")


def test_a_buggy_implementation_exits_1_with_json(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    AttentionInterface.register("doctor_cli_drops_mask", drops_mask)
    AttentionMaskInterface.register("doctor_cli_drops_mask", sdpa_mask)
    code = main(
        [
            "doctor",
            str(llama_dir),
            "--text",
            "w1 w2 w3 w4 w5",
            "--text",
            "w7 w8",
            "--json",
            "--attn-implementation",
            "doctor_cli_drops_mask",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["ok"] is False
    leaks = [f for f in data["findings"] if f["kind"] == "padding_leak"]
    assert {f["where"].split(" ")[0] for f in leaks} == {
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["doctor", "/no/such/dir", "--text", "a"], "is not a directory"),
        (["doctor", "{tmp}", "--text", "a"], "holds no config.json"),
        (["doctor", "{llama}"], "give at least one --text"),
        (["doctor", "{llama}", "--text", "a", "--html", "x.html"], "--html needs --capture"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str],
    message: str,
    llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [a.format(tmp=tmp_path, llama=llama_dir) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv doctor: error:") and message in err and "\n" not in err


def test_html_capture_writes_one_page_with_the_captured_heads(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "attention.html"
    code = main(
        [
            "doctor",
            str(llama_dir),
            "--text",
            "w1 w2 w3",
            "--text",
            "w4",
            "--html",
            str(out),
            "--capture",
            r"layers\.1\.self_attn",
        ]
    )
    assert code == 0
    assert f"attention written to {out}" in capsys.readouterr().out
    page = out.read_text(encoding="utf-8")
    # the left-padded run only: prefill and the cached step of layer 1, 4 heads each
    for call in (0, 1):
        for head in range(4):
            assert f"model.layers.1.self_attn · call {call} · sample 0 · head {head}" in page
    assert "model.layers.0.self_attn" not in page and "call 2" not in page


def test_examine_adds_the_properties_and_fails_on_a_buggy_kernel(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = ["--text", "w1 w2 w3 w4 w5", "--text", "w7 w8 w9"]
    assert main(["doctor", str(llama_dir), *texts, "--examine"]) == 0
    out = capsys.readouterr().out
    assert "examination of transformers LlamaForCausalLM (causal-lm)" in out
    assert "examination passed" in out
    AttentionInterface.register("doctor_cli_drops_mask", drops_mask)
    AttentionMaskInterface.register("doctor_cli_drops_mask", sdpa_mask)
    code = main(
        [
            "doctor",
            str(llama_dir),
            *texts,
            "--examine",
            "--json",
            "--attn-implementation",
            "doctor_cli_drops_mask",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    props = data["examination"]["properties"]
    assert props["pad_value_invariance"]["passed"] is False
    assert props["causality"]["passed"] is True
