"""Screenshots of TensorBoard's dashboards for a log directory, taken with headless Chromium
through Selenium, so that the docs show what a user sees.

    apt-get install chromium chromium-driver && pip install -e ".[docs]"
    python -m benchmarks.tensorboard_screenshots --logdir sweeps/7b/tensorboard --out docs/images

Writes ``tensorboard_<dashboard>.png`` for the Custom Scalars layout, the Scalars and Time Series
views and the HParams table, with no smoothing and "ignore outliers" off (TensorBoard keeps that setting in
the browser's local storage, not in the URL; with a few points per chart it would hide some).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from smmd_cli.options import option, parse_options

from smmd_train.distributed.launcher import free_port

# URL (after the server's address) of each dashboard; Time Series draws with WebGL unless forceSVG.
DASHBOARDS = {
    "custom_scalars": "/#custom_scalars&_smoothingWeight=0",
    "scalars": "/#scalars&_smoothingWeight=0",
    "hparams": "/#hparams",
    "timeseries": "/?forceSVG=true#timeseries",
}


def serve(logdir: str) -> tuple:
    """(server process, base URL) of a TensorBoard serving ``logdir`` once it answers."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/data/runs", timeout=5).read()
            return server, url
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit("TensorBoard did not start") from None
            time.sleep(1)


@dataclass(frozen=True)
class ScreenshotOptions:
    logdir: str = option("--logdir", required=True)
    out: str = option("--out", required=True)
    dashboards: tuple = option("--dashboards", nargs="+", default=tuple(DASHBOARDS), choices=list(DASHBOARDS))
    size: str = option("--size", default="1600,1300", help="window width,height in pixels")
    settle_seconds: float = option("--settle_seconds", type=float, default=8.0,
                                   help="time the page gets to draw its charts")


def main(argv=None) -> None:
    args, _ = parse_options(ScreenshotOptions, argv, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    from selenium import webdriver

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--window-size={args.size}"):
        options.add_argument(flag)
    server, url = serve(args.logdir)
    browser = webdriver.Chrome(options=options)
    try:
        browser.get(url)
        browser.execute_script("window.localStorage.setItem('_ignoreYOutliers', 'false')")
        for name in args.dashboards:
            browser.get(f"{url}{DASHBOARDS[name]}")
            browser.refresh()  # the dashboards read local storage when they load
            time.sleep(args.settle_seconds)
            target = out / f"tensorboard_{name}.png"
            browser.save_screenshot(str(target))
            print(target)
    finally:
        browser.quit()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
