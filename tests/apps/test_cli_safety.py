"""The CLI never loses a run and never answers with a traceback: Ctrl-C / SIGTERM save a
resumable checkpoint (real signals to a real ``qkv train``), a second writer is refused, every
bad input is one line on stderr with exit 2, a closed pipe is quiet."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

import qkv.apps.training as training
import qkv.train.loop as loop
from qkv.apps.cli import build_parser, main
from qkv.train.checkpoint import load_checkpoint

TINY = shlex.split(
    "--max-len 5 --d-model 16 --num-heads 2 --num-layers 1 --dim-feedforward 32 "
    "--batch-size 8 --eval-every 5 --eval-size 4 --no-progress"
)
QKV = [sys.executable, "-m", "qkv"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _start_training(out: Path) -> subprocess.Popen[str]:
    """A ``qkv train`` far too long to finish, returned once it has trained five steps."""
    proc = subprocess.Popen(
        [*QKV, "train", *TINY, "--steps", "1000000", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "step 5: held-out ..." once five steps are done
    assert line.startswith("step 5:"), line + proc.stderr.read()  # type: ignore[union-attr]
    return proc


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_a_resumable_checkpoint(
    tmp_path: Path, signum: signal.Signals, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real signal to a real ``qkv train`` process. The second writer and the printed resume
    command run in this test's own process (a process other than the trainer all the same), so
    the test starts one interpreter, not three."""
    out = tmp_path / "run"
    proc = _start_training(out)
    try:
        refused = main(["train", *TINY, "--steps", "10", "--out", str(out), "--overwrite"])
        second = capsys.readouterr().err
        assert refused == 2, second
        assert f"in use by another qkv process (pid {proc.pid}" in second
        assert second.count("\n") == 1 and "Traceback" not in second
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    step = load_checkpoint(out).step
    assert step >= 5
    assert f"stopped by {signum.name} after step {step}" in err
    command = err.split("continue with: ")[1].strip()
    args = shlex.split(command)
    assert args[:2] == ["qkv", "train"] and args[-1] == "--resume"
    resumed = main([*args[1:], "--stop-after", str(step + 2)])
    assert resumed == 0, capsys.readouterr().err
    assert load_checkpoint(out).step == step + 2


def _bad_inputs(tmp: Path) -> list[list[str]]:
    (tmp / "dir").mkdir()
    (tmp / "file").write_text("x")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    return [
        ["train", "--threads", "0"],
        ["train", "--text", str(tmp / "missing.txt")],
        ["train", "--text", str(tmp / "dir")],
        ["train", "--text", str(tmp / "dangling")],
        ["train", "--save-every", "-1"],
        ["train", "--stop-after", "-1"],
        ["train", "--target-accuracy", "7"],
        ["train", "--d-model", "0"],
        ["train", *TINY, "--steps", "3", "--out", str(tmp / "file")],
        ["train", *TINY, "--steps", "3", "--out", str(tmp / "file" / "sub")],
        ["plot", str(tmp), "--positional", "--length", "1000000000"],
        ["bench", "--device", "cpu"],
        ["shapes", "--query-len", "100000", "--key-len", "100000"],
        ["shapes", "--T", "0"],
        ["generate", str(tmp / "missing"), "abc"],
        ["generate", str(tmp), "abc", "--beam", "0"],
        ["embed", "hello", "--model", str(tmp / "missing")],
        ["embed", "hello", "--backend", "bogus"],
        ["no-such-command"],
    ]


def test_every_bad_input_is_one_line_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in _bad_inputs(tmp_path):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own refusals
            code = int(exit_.code or 0)
        out, err = capsys.readouterr()
        assert code == 2, (argv, out, err)
        assert out == "" and err.count("\n") == 1 and "error:" in err, (argv, out, err)


def test_no_traceback_from_the_installed_command(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    run = subprocess.run(
        [*QKV, "train", "--text", str(tmp_path / "dir")], capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stdout == ""
    assert (
        run.stderr.startswith("qkv train: error: argument --text:")
        and "Traceback" not in run.stderr
    )


def test_a_closed_pipe_is_quiet() -> None:
    proc = subprocess.Popen(
        [*QKV, "shapes", "--model"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head` does once it has read enough
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"qkv {version('qkv')}\n"


def test_every_command_has_a_description_an_example_and_described_flags() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert command.description, name
        assert command.epilog.startswith("example:\n  qkv " + name), name
        for action in command._actions:
            if action.help == "==SUPPRESS==" or action.dest == "help":
                continue
            assert action.help, (name, action.dest)
            flags = [f for f in action.option_strings if f.startswith("--")]
            assert all(f == f.lower() for f in flags), (name, flags)
        choices = [str(c) for a in command._actions for c in (a.choices or [])]
        assert not any(" " in c for c in choices), (name, choices)
        text = command.format_help()
        assert "--B " not in text and "--Dh" not in text, name


def test_old_spellings_still_parse() -> None:
    parser = build_parser()
    old = parser.parse_args(["shapes", "--B", "3", "--H", "2", "--T", "4", "--S", "6", "--Dh", "5"])
    new = parser.parse_args(
        [
            "shapes",
            "--batch",
            "3",
            "--heads",
            "2",
            "--query-len",
            "4",
            "--key-len",
            "6",
            "--head-dim",
            "5",
        ]
    )
    assert vars(old) == vars(new)
    kinds = parser.parse_args(["plot", "ckpt", "x", "--kind", "encoder-self", "--kind", "cross"])
    assert kinds.kind == ["encoder self", "cross"]


def test_two_sigterms_exit_143(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27: a second SIGTERM (stop at once, no save) exited 130 with "interrupted", Ctrl-C's
    code; it is 128 + SIGTERM. The real handler of ``qkv train``, two real signals."""

    def two_sigterms(cfg: object, opts: object) -> object:
        with loop._StopOnSignal().installed():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the second signal's handler raises before this ends
        raise AssertionError("the second signal did not stop the run")

    monkeypatch.setattr(training, "train", two_sigterms)
    assert main(["train", *TINY, "--steps", "3"]) == 143
    assert "interrupted (SIGTERM)" in capsys.readouterr().err
