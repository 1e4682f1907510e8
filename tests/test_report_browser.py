"""The report in a real browser: headless Chromium, network blocked, every figure decoded, no request out.

Skips with the reason where Chromium is absent (.ci/run installs Debian's `chromium` where apt works).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_report import FIGURES, fixture_run

from stages import report

PROBE = """<script>
window.addEventListener("load", () => {
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    images: [...document.images].map((img) => [img.complete, img.naturalWidth]),
    requests: performance.getEntriesByType("resource").map((e) => e.name),
  });
  document.body.appendChild(out);
});
</script>
"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.skip("Chromium not installed (apt-get install chromium); .ci/run installs it where apt works")


BLINK_LOADER = 101845102  # Chromium's traffic annotation for requests a page makes (its own updater's differ)


def open_offline(browser: str, page: Path, tmp: Path) -> tuple[dict, set[str]]:
    """Load `page` with the network blocked; returns the probe's findings and every URL the page asked for."""
    netlog = tmp / "net.json"
    result = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            f"--user-data-dir={tmp / 'profile'}",
            "--proxy-server=127.0.0.1:9",  # nothing listens there: the network is blocked
            "--host-resolver-rules=MAP * ~NOTFOUND",
            f"--log-net-log={netlog}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    probe = re.search(r'<pre id="probe">(.*?)</pre>', result.stdout, re.S)
    assert probe, f"the page did not load in Chromium:\n{result.stderr[-2000:]}"
    seen = json.loads(probe.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    requests = re.findall(r'"traffic_annotation":(\d+),"url":"([^"]+)"', netlog.read_text())
    asked = {url for tag, url in requests if int(tag) == BLINK_LOADER and not url.startswith(("file:", "data:"))}
    return seen, asked


def with_probe(html: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html.replace("</body>", PROBE + "</body>"))
    return path


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_report_opens_offline_with_every_figure_decoded(workdir: Path, tmp_path: Path, device: str) -> None:
    browser = chromium()
    fixture_run(workdir, device)
    report.main()
    page = with_probe((workdir / "reports/report.html").read_text(), tmp_path / "page" / "report.html")
    seen, asked = open_offline(browser, page, tmp_path)
    assert len(seen["images"]) == len(FIGURES)
    assert all(complete and width > 0 for complete, width in seen["images"]), seen["images"]
    assert seen["requests"] == [] and asked == set()  # data: images are not fetched


def test_the_check_sees_a_request_and_a_broken_image(tmp_path: Path) -> None:
    """The control: a page with one outside image is caught, so a passing report means something."""
    browser = chromium()
    html = '<!DOCTYPE html><html><body><img src="http://cdn.example.invalid/figure.png"></body></html>'
    seen, asked = open_offline(browser, with_probe(html, tmp_path / "page" / "bad.html"), tmp_path)
    assert asked == {"http://cdn.example.invalid/figure.png"}
    assert seen["images"][0][1] == 0
