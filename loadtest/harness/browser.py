"""Headless Chromium over the DevTools protocol (CDP), for checking /dashboard in a real
browser: Debian's ``chromium`` package, driven through its websocket with ``websockets``
(no playwright, no browser download).

    with Browser() as b:                 # starts chromium --headless on a free port
        b.goto("http://127.0.0.1:8000/dashboard")
        b.evaluate("document.title")     # -> the value (JSON-able)
        png = b.screenshot(selector="canvas")   # bytes; clipped to that element
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    def __init__(self, width: int = 1280, height: int = 1000, timeout_s: float = 30.0) -> None:
        exe = find_chromium()
        if exe is None:
            raise RuntimeError("no chromium on PATH (apt-get install -y chromium)")
        self._dir = tempfile.mkdtemp(prefix="pagedserve-chromium-")
        self._timeout = timeout_s
        # --no-sandbox: the tests run as root in a container, where the sandbox cannot start.
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={self._dir}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = self._port()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t.get("type") == "page"]
        self._ws_url = pages[0]["webSocketDebuggerUrl"]
        self._loop = asyncio.new_event_loop()
        self._ws = self._loop.run_until_complete(self._connect())
        self._next_id = 0

    def _port(self) -> int:
        path = os.path.join(self._dir, "DevToolsActivePort")
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if os.path.exists(path):
                lines = open(path).read().split()
                if lines:
                    return int(lines[0])
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    async def _connect(self):
        import websockets

        return await websockets.connect(self._ws_url, max_size=64 << 20)

    async def _send(self, method: str, params: dict | None) -> dict:
        self._next_id += 1
        mid = self._next_id
        await self._ws.send(json.dumps({"id": mid, "method": method, "params": params or {}}))
        while True:  # events (no id) interleave with replies
            msg = json.loads(await asyncio.wait_for(self._ws.recv(), self._timeout))
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def call(self, method: str, params: dict | None = None) -> dict:
        return self._loop.run_until_complete(self._send(method, params))

    def goto(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str):
        res = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True})
        if "exceptionDetails" in res:
            raise RuntimeError(f"evaluate {expression!r}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20.0):
        """Poll a JS expression until it is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.2)

    def screenshot(self, selector: str | None = None) -> bytes:
        params: dict = {"format": "png"}
        if selector is not None:
            rect = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                                 ".getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()")
            params["clip"] = dict(x=rect[0], y=rect[1], width=max(1, rect[2]), height=max(1, rect[3]),
                                  scale=1)
        return base64.b64decode(self.call("Page.captureScreenshot", params)["data"])

    def close(self) -> None:
        try:
            self._loop.run_until_complete(self._ws.close())
        except Exception:
            pass
        self._loop.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
