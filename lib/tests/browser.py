"""A real browser for the MLflow UI tests: headless Chromium driven over the DevTools protocol
(aiohttp's websocket client), so a test reads what a reviewer sees at a window's size: the
text of each element as laid out, cut where its column cuts it, and a screenshot."""

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp


def chromium() -> str | None:
    """The Chromium on this machine (.ci/run installs Debian's), or None."""
    names = ("chromium", "chromium-browser", "google-chrome")
    return next(filter(None, map(shutil.which, names)), None)


# The part of each matching element's text that is on the screen: the characters whose box ends
# inside the element's (and its clipping ancestors') visible box; ellipsis and overflow left out.
VISIBLE_TEXT = """
(selector) => Array.from(document.querySelectorAll(selector)).map((cell) => {
  let right = cell.getBoundingClientRect().right;
  for (let up = cell; up; up = up.parentElement) {
    const style = getComputedStyle(up);
    if (style.overflow !== 'visible' || style.overflowX !== 'visible') {
      right = Math.min(right, up.getBoundingClientRect().right);
    }
  }
  right = Math.min(right, window.innerWidth);
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  let shown = '', full = '';
  const range = document.createRange();
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (let i = 0; i < node.length; i++) {
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      const box = range.getBoundingClientRect();
      full += node.data[i];
      if (box.width === 0 || box.right <= right + 0.5) shown += node.data[i];
    }
  }
  return {full: full.trim(), shown: shown.trim()};
})
"""


class Page:
    """One tab of a headless Chromium, at a window's size."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse, loop: asyncio.AbstractEventLoop):
        self.socket = socket
        self.loop = loop
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict:
        return self.loop.run_until_complete(self._call(method, params))

    async def _call(self, method: str, params: dict) -> dict:
        number = next(self.ids)
        await self.socket.send_str(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads((await self.socket.receive()).data)
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, selector: str, count: int = 1, timeout: float = 60) -> None:
        """Until ``count`` elements match ``selector`` (the UI renders after its requests)."""
        deadline = time.monotonic() + timeout
        query = f"document.querySelectorAll({json.dumps(selector)}).length"
        while (found := self.evaluate(query)) < count:
            if time.monotonic() > deadline:
                text = self.evaluate("document.body.innerText")[:3000]
                raise TimeoutError(f"{found} of {count} {selector} after {timeout} s: {text}")
            time.sleep(0.25)

    def visible_texts(self, selector: str) -> list[dict[str, str]]:
        """Each matching element's whole text and the part of it on the screen."""
        return self.evaluate(f"({VISIBLE_TEXT})({json.dumps(selector)})")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path


@contextmanager
def browser_page(folder: Path, width: int = 1600, height: int = 1000) -> Iterator[Page]:
    """A headless Chromium (its profile in ``folder``) with one page of ``width`` x ``height``
    (MLflow's default layout at 1600 x 1000), closed with everything it started."""
    proc = subprocess.Popen(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--remote-debugging-port=0",
            f"--user-data-dir={folder}",
            f"--window-size={width},{height}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    loop = asyncio.new_event_loop()
    try:
        for line in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/..."
            if match := re.search(r"ws://([\d.]+:\d+)/", line):
                break
        else:
            raise RuntimeError("Chromium never said where its DevTools listen")
        session, socket = loop.run_until_complete(_first_page(match.group(1)))
        page = Page(socket, loop)
        page.call("Page.enable")
        page.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        try:
            yield page
        finally:
            loop.run_until_complete(socket.close())
            loop.run_until_complete(session.close())
    finally:
        proc.kill()
        proc.wait()
        loop.close()


async def _first_page(address: str) -> tuple[aiohttp.ClientSession, Any]:
    session = aiohttp.ClientSession()
    async with session.get(f"http://{address}/json") as answer:
        targets = await answer.json(content_type=None)
    (page,) = [target for target in targets if target["type"] == "page"]
    socket = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
    return session, socket
