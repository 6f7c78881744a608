"""Open a page in headless Chromium and run JavaScript in it: how the view is tested and timed.

``chromium --dump-dom`` returns the DOM when the page has loaded, before an asynchronous decode
(``createImageBitmap``) has finished, and ``--virtual-time-budget`` fast-forwards the clock past
it. This drives the browser through its DevTools protocol over a pipe instead
(``--remote-debugging-pipe``: JSON messages ending in NUL on file descriptors 3 and 4, no port, no
network), so a probe can ``await`` the page and read real ``performance.now()`` times.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from types import TracebackType
from typing import Any

__all__ = ["Browser", "chromium"]

_WIRE = (
    "import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
    "os.close(r); os.close(w); os.execvp(sys.argv[3], sys.argv[3:])"
)


def chromium() -> str | None:
    """The path of Debian's ``chromium`` (or ``chromium-browser``); None when there is none."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium, driven over the DevTools pipe; use it as a context manager.

    Args:
        executable: the browser (default: :func:`chromium`).
        width: the browser window's width, CSS pixels (the page gets a little less height).
        height: the window's height.
        timeout: seconds to wait for any one answer.

    Raises:
        FileNotFoundError: no browser found.
    """

    def __init__(
        self,
        executable: str | None = None,
        *,
        width: int = 1400,
        height: int = 1000,
        timeout: float = 60.0,
    ) -> None:
        exe = executable or chromium()
        if exe is None:
            raise FileNotFoundError("no chromium found (apt-get install chromium)")
        self.width, self.height, self.timeout = width, height, timeout
        self._profile = tempfile.TemporaryDirectory(prefix="qkv-chromium-")
        to_browser = _pipe_above(5)  # the browser reads it on fd 3
        from_browser = _pipe_above(5)  # and writes this one on fd 4
        child_in, child_out = to_browser[0], from_browser[1]
        self._proc = subprocess.Popen(
            [
                sys.executable,  # a trampoline: the pipe ends onto fds 3 and 4, then exec
                "-c",
                _WIRE,
                str(child_in),
                str(child_out),
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(child_in, child_out),
        )
        os.close(child_in)
        os.close(child_out)
        self._send_fd, self._recv_fd = to_browser[1], from_browser[0]
        self._buffer = b""
        self._next_id = 0
        self._targets: dict[str, str] = {}

    def __enter__(self) -> Browser:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Ask the browser to quit, end it if it does not, and remove its profile."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                self._call("Browser.close", {})
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for fd in (self._send_fd, self._recv_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._profile.cleanup()

    def _call(self, method: str, params: dict[str, Any], session: str | None = None) -> Any:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._send_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([self._recv_fd], [], [], max(0.0, left))
                if not ready:
                    raise TimeoutError(f"chromium gave no answer to {method} in {self.timeout} s")
                chunk = os.read(self._recv_fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") != self._next_id:
                continue  # an event, or the answer to a call that timed out
            if "error" in answer:
                raise RuntimeError(f"chromium refused {method}: {answer['error']}")
            return answer["result"]

    def open(self, url: str) -> str:
        """Open ``url`` in a new tab and wait until its document has loaded.

        Returns:
            The tab's session id, for :meth:`evaluate`.
        """
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})
        sid: str = session["sessionId"]
        self._targets[sid] = target
        self._call("Page.navigate", {"url": url}, sid)
        self.evaluate(
            "new Promise((done) => { const go = () => document.readyState === 'complete' && "
            "location.href !== 'about:blank' ? done() : setTimeout(go, 20); go(); })",
            sid,
        )
        return sid

    def close_page(self, session: str) -> None:
        """Close the tab :meth:`open` returned ``session`` for."""
        self._call("Target.closeTarget", {"targetId": self._targets.pop(session)})

    def evaluate(self, expression: str, session: str) -> Any:
        """The value of ``expression`` in the tab (a promise is awaited), as JSON would carry it.

        Raises:
            RuntimeError: the expression threw; the message holds the page's exception.
        """
        result = self._call(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
            session,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise RuntimeError(f"the page threw: {text}")
        return result["result"].get("value")


def _pipe_above(lowest: int) -> tuple[int, int]:
    """``os.pipe()`` with both ends moved to descriptors >= ``lowest``, so that wiring them onto
    3 and 4 cannot overwrite one end with the other."""
    ends = []
    for fd in os.pipe():
        ends.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest))
        os.close(fd)
    return ends[0], ends[1]
