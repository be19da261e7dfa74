"""Render the SVG with Graphviz and load the HTML page in headless Chromium.

Locally the tests skip when ``dot`` or Chromium is missing; under CI (``CI`` set) a missing
binary fails them, since CI installs both (``apt-get install graphviz chromium``).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET

import pytest
from conftest import dit_inputs, tiny_dit

import tread_fx
from tread_fx.inspection.render import to_html, to_svg

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)


def _require(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    message = f"none of {names} is installed"
    if os.environ.get("CI"):
        pytest.fail(f"{message}, but CI must install it (apt-get install graphviz chromium)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def explanation():
    return tread_fx.explain(tiny_dit(depth=4), [(1, 3)], 0.5, dit_inputs(batch=1))


def test_svg_is_rendered_by_graphviz(explanation):
    _require("dot")
    svg = to_svg(explanation)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    for label in ("gather_tokens", "scatter_tokens", "select_random", "blocks.1 (DiTBlock)"):
        assert label in texts


def _chromium(binary: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(command, capture_output=True, timeout=120, check=False, cwd=tmp_path)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_html_page_loads_in_headless_chromium(explanation, tmp_path):
    binary = _require(*CHROMIUM_NAMES)
    page = tmp_path / "explain.html"
    page.write_text(to_html(explanation), encoding="utf-8")
    url = page.resolve().as_uri()

    shot = tmp_path / "shot.png"
    result = _chromium(binary, tmp_path, f"--screenshot={shot}", "--window-size=1400,1000", url)
    assert shot.exists(), result.stderr.decode(errors="replace")[-2000:]
    data = shot.read_bytes()
    assert _png_size(data) == (1400, 1000)
    assert len(data) > 20_000, "the screenshot is (nearly) blank"

    result = _chromium(binary, tmp_path, "--dump-dom", url)
    dom = result.stdout.decode(errors="replace")
    assert "<svg" in dom and 'id="panel-routed"' in dom and 'id="panel-original"' in dom
    for name, role in (
        ("select_random", "select"),
        ("gather_tokens", "gather"),
        ("scatter_tokens", "scatter"),
        ("tread_noise_0", "noise"),
    ):
        assert f'id="routed-{name}"' in dom and f'data-role="{role}"' in dom
    assert 'class="node gather inserted"' in dom and 'class="node scatter inserted"' in dom
    assert "route 0: blocks 1..2 on 8 of 16 tokens" in dom


def test_graphs_fit_their_panels_and_edge_labels_sit_beside_the_edges(explanation, tmp_path):
    """Laid out by Chromium at 1400 px: no graph is cut off on the right of its panel."""
    binary = _require(*CHROMIUM_NAMES)
    measure = (
        "<script>window.addEventListener('load', () => {"
        "const out = [...document.querySelectorAll('.panel')].map(p => {"
        "const s = p.querySelector('svg').getBoundingClientRect();"
        "const b = p.getBoundingClientRect();"
        "return s.right <= b.right + 1 && s.left >= b.left - 1; });"
        "document.body.setAttribute('data-fit', out.join(','));});</script>"
    )
    page = tmp_path / "fit.html"
    page.write_text(to_html(explanation).replace("</body>", measure + "</body>"), "utf-8")
    result = _chromium(
        binary, tmp_path, "--window-size=1400,1000", "--dump-dom", page.resolve().as_uri()
    )
    dom = result.stdout.decode(errors="replace")
    assert 'data-fit="true,true"' in dom, dom[:300]
    assert 'viewBox="0 0 ' in dom  # scaled down to the panel width, never up
