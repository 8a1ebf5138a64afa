#!/usr/bin/env python
"""Screenshot a web page with headless Chromium once it shows given text; no dependency beyond Python.

    python tests/ui/screenshot.py URL out.png --size 1400x1000 --wait-for demo-pretrain --wait-for eval/top1
    python tests/ui/screenshot.py URL out.png --css '.modebar{display:none}' --click 'button[aria-label="x"]' --dom out.html

Chromium's own `--screenshot` takes the picture when a virtual-time budget runs out, which can be
before a page such as MLflow's UI has loaded its chart library. This drives Chromium over the
DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON messages separated by NUL bytes on file
descriptors 3 and 4, so no WebSocket client is needed): load, wait until every --wait-for text is on
the page (bounded by --timeout), optionally add CSS and click an element, let it settle, capture.

Exit status 0 with the PNG written; 1 if the texts never appeared (the PNG and DOM are still written,
to see why); 2 if Chromium could not be started. `--host-map NAME=IP` resolves NAME to IP inside
Chromium only (MLflow's UI behaves differently on localhost; see tests/integration/test_mlflow_ui.py).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    return None


class Browser:
    """One headless Chromium, one page, spoken to over --remote-debugging-pipe."""

    def __init__(self, chromium: str, profile: Path, size: tuple[int, int], host_map: dict[str, str]):
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        rules = ",".join(f"MAP {name} {ip}" for name, ip in host_map.items())
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-extensions", "--hide-scrollbars", "--remote-debugging-pipe",
               f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
               *([f"--host-resolver-rules={rules}"] if rules else []), "about:blank"]

        def fds() -> None:  # in the child: Chromium reads commands on fd 3 and answers on fd 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=fds, pass_fds=(3, 4))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.session: str | None = None

    def close(self) -> None:
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def _read_message(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""
                raise RuntimeError(f"Chromium closed the DevTools pipe:\n{err}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def attach(self) -> None:
        pages = [t for t in self.call("Target.getTargets", session=False)["targetInfos"] if t["type"] == "page"]
        target = pages[0]["targetId"] if pages else self.call("Target.createTarget", {"url": "about:blank"},
                                                               session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]

    def evaluate(self, expression: str):
        out = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        return out.get("result", {}).get("value")


def shoot(url: str, png: Path, size: tuple[int, int] = (1400, 1000), wait_for: list[str] = (),
          timeout: float = 60.0, settle: float = 1.5, css: str = "", click: list[str] = (),
          dom: Path | None = None, host_map: dict[str, str] | None = None, chromium: str | None = None) -> bool:
    """Screenshot `url` into `png`; True when every `wait_for` text appeared within `timeout` seconds."""
    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError("no Chromium on PATH (bash tests/ui/install_chromium.sh installs it)")
    # ignore_cleanup_errors: Chromium's helper processes can still be writing the profile as the browser
    # exits ("Directory not empty: 'Default'", seen once in CI); a leftover temp folder must not fail a test.
    with tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile:
        browser = Browser(chromium, Path(profile), size, host_map or {})
        try:
            browser.attach()
            browser.call("Page.enable")
            browser.call("Emulation.setDeviceMetricsOverride",
                         {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": False})
            browser.call("Page.navigate", {"url": url})
            found = _wait(browser, wait_for, timeout)
            if css:
                browser.evaluate("(() => { const s = document.createElement('style'); "
                                 f"s.textContent = {json.dumps(css)}; document.head.appendChild(s); }})()")
            for selector in click if found else ():
                found = found and bool(browser.evaluate(
                    f"(() => {{ const el = document.querySelector({json.dumps(selector)}); "
                    "if (!el) return false; el.click(); return true; })()"))
                time.sleep(0.3)
            time.sleep(settle)  # charts animate in; a click re-renders
            shot = browser.call("Page.captureScreenshot", {"format": "png"})
            png.parent.mkdir(parents=True, exist_ok=True)
            png.write_bytes(base64.b64decode(shot["data"]))
            if dom is not None:
                dom.write_text(browser.evaluate("document.documentElement.outerHTML") or "")
            return found
        finally:
            browser.close()


def _wait(browser: Browser, texts: list[str], timeout: float) -> bool:
    check = "(() => { const t = document.body ? document.body.innerText : ''; return " + json.dumps(list(texts)) + \
            ".every(x => t.includes(x)); })()"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if browser.evaluate(check):
            return True
        time.sleep(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("png", type=Path)
    ap.add_argument("--size", default="1400x1000", help="WIDTHxHEIGHT of the page (default 1400x1000)")
    ap.add_argument("--wait-for", action="append", default=[], help="text the page must show (repeatable)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for those texts")
    ap.add_argument("--settle", type=float, default=1.5, help="seconds between the texts appearing and the capture")
    ap.add_argument("--css", default="", help="CSS added to the page before the capture")
    ap.add_argument("--click", action="append", default=[],
                    help="CSS selector of an element to click once the texts are there (repeatable, in order)")
    ap.add_argument("--dom", type=Path, help="also write the page's HTML here")
    ap.add_argument("--host-map", action="append", default=[], help="NAME=IP, resolved inside Chromium only")
    args = ap.parse_args(argv)
    width, _, height = args.size.partition("x")
    host_map = dict(item.split("=", 1) for item in args.host_map)
    try:
        ok = shoot(args.url, args.png, (int(width), int(height)), args.wait_for, args.timeout, args.settle,
                   args.css, args.click, args.dom, host_map)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"screenshot: {e}", file=sys.stderr)
        return 2
    if not ok:
        print(f"screenshot: {args.url} did not show {args.wait_for} within {args.timeout:g}s; "
              f"wrote what it showed to {args.png}", file=sys.stderr)
        return 1
    print(f"screenshot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
