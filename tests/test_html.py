"""The HTML report: one self-contained file; in a real headless browser (Debian's chromium) it loads
without console errors and draws its figures. The browser tests skip when chromium is not installed."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest
import yaml

from fsdp_sim.cli import main

TINY = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 32},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}}
BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no chromium (CI installs Debian's)")


def _scenario(tmp_path, data=TINY):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _self_contained(text: str) -> None:
    """Nothing to fetch at view time: no external script, style, image, font or frame."""
    assert not re.search(r"<(script|img|iframe|link)[^>]*\s(src|href)=", text, re.I)
    assert "@import" not in text and "url(" not in text and "fetch(" not in text
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")


def _load(path) -> tuple[dict, str]:
    """The page's <body> attributes after its script ran in a 1400 px wide window, and the browser's console
    lines."""
    p = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        "--window-size=1400,1000",
                        "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=5000", "--dump-dom",
                        f"file://{path}"], capture_output=True, text=True, timeout=120)
    body = re.search(r"<body([^>]*)>", p.stdout)
    assert body, p.stderr[-2000:]
    attrs = {k: html.unescape(v) for k, v in re.findall(r'([\w-]+)="([^"]*)"', body.group(1))}
    console = "\n".join(line for line in p.stderr.splitlines() if "CONSOLE" in line)
    return attrs, console


def test_run_report_is_self_contained_and_has_the_sections(tmp_path):
    out = tmp_path / "run.html"
    assert main(["run", _scenario(tmp_path), "-q", "--html", str(out)]) == 0
    text = out.read_text()
    _self_contained(text)
    for needle in ('id="timeline"', 'id="gantt"', "Breakdown at the peak", "Largest live buffers", "Peak allocated"):
        assert needle in text


def test_sweep_and_recommend_reports(tmp_path):
    path = _scenario(tmp_path)
    grid = ["--set", "training.micro_batch=1,2", "--set", "fsdp.wrap=per_block,whole_model", "--jobs", "1", "-q"]
    assert main(["sweep", path, *grid, "--html", str(tmp_path / "sweep.html")]) == 0
    assert main(["recommend", path, *grid, "--html", str(tmp_path / "rec.html")]) == 0
    for name in ("sweep.html", "rec.html"):
        text = (tmp_path / name).read_text()
        _self_contained(text)
        assert 'id="pareto"' in text and "class=sortable" in text
    assert (tmp_path / "sweep.html").read_text().count("<tr") == 1 + 4  # the header and the four points
    assert "Recommendation" in (tmp_path / "rec.html").read_text() and 'class="best"' in (tmp_path / "rec.html").read_text()


@needs_browser
def test_run_report_in_a_browser(tmp_path):
    out = tmp_path / "run.html"
    assert main(["run", "scenarios/llama3-8b-8xh100.yaml", "-q", "--html", str(out)]) == 0
    attrs, console = _load(out)
    assert console == "" and "data-errors" not in attrs and attrs.get("data-ready") == "1"
    figures = json.loads(attrs["data-figures"])
    assert set(figures) == {"timeline", "gantt"}
    assert attrs["data-wide"] == "0"  # the summary wraps at 1400 px instead of scrolling sideways
    for width, height, elements in figures.values():
        assert width > 500 and height > 50 and elements > 10  # drawn, not empty


@needs_browser
def test_recommend_report_in_a_browser(tmp_path):
    out = tmp_path / "rec.html"
    grid = ["--set", "training.micro_batch=1,2,4", "--set", "fsdp.backward_prefetch=true,false", "--jobs", "1", "-q"]
    assert main(["recommend", _scenario(tmp_path), *grid, "--html", str(out)]) == 0
    attrs, console = _load(out)
    assert console == "" and "data-errors" not in attrs and attrs.get("data-ready") == "1"
    width, height, elements = json.loads(attrs["data-figures"])["pareto"]
    assert width > 500 and height > 100 and elements >= 6 + 10  # six points, a star, axes


@needs_browser
def test_a_script_error_would_be_seen(tmp_path):
    """The check above can fail: a page whose script throws shows up in the console lines."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><body><script>undefined_function();</script></body></html>")
    _, console = _load(page)
    assert "undefined_function" in console


def test_the_png_and_the_html_colour_a_key_alike_and_zoom_the_memory_axis(tmp_path):
    """One key, one colour (tab10 in both); the memory axis zooms to the points and turns logarithmic past 8x."""
    from fsdp_sim.results import svg
    from fsdp_sim.results.pareto import SERIES_COLOURS, memory_axis

    rows = [{"k": k, "required_bytes": int(gib * 2**30), "headroom_bytes": int((70 - gib) * 2**30), "fits": gib < 80,
             "within_budget": gib < 70, "tokens_per_s_per_gpu": tps, "error": ""}
            for k, gib, tps in (("a", 30, 100), ("b", 40, 120), ("a", 600, 130))]
    page = svg.pareto(rows, ["k"])
    assert f"background:{SERIES_COLOURS[0]}" in page and f"background:{SERIES_COLOURS[1]}" in page
    assert "log scale" in page
    lo, hi, log = memory_axis([30, 40, 600], 70)
    assert log and 25 < lo < 30 and 600 < hi < 700
    lo, hi, log = memory_axis([30, 40, 50], 70)
    assert not log and 25 < lo < 30 and 70 < hi < 75  # zoomed, not from 0
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from fsdp_sim.results.plot import pareto_figure
    fig = pareto_figure(rows, "k")
    faces = {to_hex(c.get_edgecolor()[0]) for c in fig.axes[0].collections if len(c.get_offsets())}
    assert {SERIES_COLOURS[0], SERIES_COLOURS[1]} <= faces
    assert fig.axes[0].get_xscale() == "log"
