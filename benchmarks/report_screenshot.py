"""A compare report as a reader sees it: headless Chromium renders a report folder's report.html at 1400x900 (the
first screen) and 1400 px wide over the page's whole height, and a check run inside the page says whether anything
runs past the right edge of the window (with the "All measurements" details closed, as the page opens, and open):

    python benchmarks/report_screenshot.py benchmarks/compare_quick_repeats3_cpu-avx512_2026-11-23 \
        benchmarks/report_screenshot_cpu_2026-11-24.png --full /tmp/report_full.png

Needs ``chromium-headless-shell`` (Debian: apt-get install chromium-headless-shell) or ``chromium`` (--browser).
The page is one offline file (charts as data: URLs), so it is opened from a temporary copy, with nothing served.
Exit status 1 when something overflows the page, 2 for bad input; tables wider than the window are fine when
they scroll inside their own box (``.scroll``: overflow-x:auto), which the check lists.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs once the page (and its data: images) has loaded: measures the layout with every <details> as the page
# opens and again with all of them open, and writes the result into the DOM, which --dump-dom prints.
CHECK_SCRIPT = """<script>
window.addEventListener('load', function () {
  function name(el) {
    return el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') + (el.className ? '.' + String(el.className).trim().replace(/\\s+/g, '.') : '');
  }
  function measure(state) {
    var width = document.documentElement.clientWidth;
    var out = {state: state, window: width, page: document.documentElement.scrollWidth,
               height: document.documentElement.scrollHeight, overflowing: [], scrolling: []};
    function shown(el) { return el.checkVisibility ? el.checkVisibility() : el.getClientRects().length > 0; }
    document.querySelectorAll('body *').forEach(function (el) {
      var box = el.getBoundingClientRect();
      if (!shown(el) || (box.width === 0 && box.height === 0)) return;  // in a closed <details>, a <script>
      var inner = el.parentElement && el.parentElement.closest('.scroll');
      if (inner) return;  // inside a box that scrolls sideways: clipped there, not past the page
      if (box.right > width + 0.5) out.overflowing.push(name(el) + ' ends at ' + Math.round(box.right) + ' px');
    });
    document.querySelectorAll('.scroll').forEach(function (el) {
      if (!shown(el)) return;
      var table = el.querySelector('table');
      out.scrolling.push({table: table ? name(table) : name(el), content: el.scrollWidth, box: el.clientWidth});
    });
    return out;
  }
  var details = Array.prototype.slice.call(document.querySelectorAll('details'));
  var closed = measure('as the page opens');
  details.forEach(function (d) { d.open = true; });
  var opened = measure('every <details> open');
  details.forEach(function (d) { d.open = false; });
  var pre = document.createElement('pre');
  pre.id = 'layout-check';
  pre.textContent = JSON.stringify([closed, opened]);
  document.body.appendChild(pre);
});
</script>"""

OPEN_SCRIPT = """<script>
document.querySelectorAll('details').forEach(function (d) { d.open = true; });
</script>"""


def _browser(name: str) -> str:
    """The browser binary, or a one-line exit naming the Debian package."""
    found = shutil.which(name) or (shutil.which("chromium") if name == "chromium-headless-shell" else None)
    if found is None:
        sys.exit(f"{name} not found (Debian: apt-get install chromium-headless-shell)")
    return found


def _with_script(page: Path, script: str, tmp: Path, name: str) -> Path:
    """A copy of ``page`` with ``script`` before </body>, in ``tmp`` (the report itself is never changed)."""
    text = page.read_text(encoding="utf-8")
    cut = text.rfind("</body>")
    copy = tmp / name
    copy.write_text(text[:cut] + script + text[cut:] if cut >= 0 else text + script, encoding="utf-8")
    return copy


def _chromium(browser: str, args: list[str], width: int, height: int, url: str) -> str:
    """Run headless Chromium on ``url`` at ``width`` x ``height``; its stdout (the DOM with --dump-dom)."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
           f"--window-size={width},{height}", "--virtual-time-budget=20000", *args, url]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"{Path(browser).name} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout


def layout_check(browser: str, page: Path, tmp: Path, width: int, height: int) -> list[dict]:
    """The page's layout measured in the browser: per state, the page and window widths, the elements whose right
    edge is past the window, and each sideways-scrolling table's content and box widths."""
    copy = _with_script(page, CHECK_SCRIPT, tmp, "check.html")
    dom = _chromium(browser, ["--dump-dom"], width, height, copy.as_uri())
    found = re.search(r'<pre id="layout-check">(.*?)</pre>', dom, re.S)
    if not found:
        sys.exit("the layout check did not run in the page (no #layout-check in the dumped DOM)")
    return json.loads(html.unescape(found.group(1)))


def screenshot(browser: str, page: Path, out: Path, width: int, height: int) -> None:
    """A PNG of ``page`` in a ``width`` x ``height`` window (the page's top)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _chromium(browser, [f"--screenshot={out.resolve()}"], width, height, page.as_uri())
    if not out.is_file():
        sys.exit(f"no screenshot written to {out}")


def _report(states: list[dict]) -> bool:
    """Print one line per state and per overflowing element; True when nothing runs past the window."""
    fine = True
    for s in states:
        tables = (
            ", ".join(f"{t['table']} {t['content']} px in a {t['box']} px box" for t in s["scrolling"])
            or "none"
        )
        print(f"layout ({s['state']}): page {s['page']} px wide in a {s['window']} px window, {s['height']} px tall; "
              f"{len(s['overflowing'])} element(s) past the right edge; tables in a scroll box: {tables}")  # fmt: skip
        for what in s["overflowing"][:20]:
            print(f"  overflows: {what}")
        fine = fine and not s["overflowing"] and s["page"] <= s["window"]
    return fine


def main(argv: list[str] | None = None) -> int:
    """Screenshots of the first screen and (--full) of the whole page, then the layout check; 1 if it overflows."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "report", type=Path, help="a report folder (stratbench compare / report output) or its report.html"
    )
    ap.add_argument("output", type=Path, help="the PNG of the first screen (width x height)")
    ap.add_argument("--full", type=Path, default=None, help="also a PNG of the whole page at the same width")
    ap.add_argument(
        "--open", action="store_true", help="open every <details> (the full table) in the screenshots"
    )
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=900)
    ap.add_argument("--browser", default="chromium-headless-shell")
    args = ap.parse_args(argv)
    page = args.report / "report.html" if args.report.is_dir() else args.report
    if not page.is_file():
        print(f"no report.html at {page}: render one with `stratbench report {args.report}`", file=sys.stderr)
        return 2
    browser = _browser(args.browser)
    with tempfile.TemporaryDirectory() as tmp:
        states = layout_check(browser, page.resolve(), Path(tmp), args.width, args.height)
        shown = _with_script(page, OPEN_SCRIPT, Path(tmp), "open.html") if args.open else page.resolve()
        screenshot(browser, shown, args.output, args.width, args.height)
        print(f"wrote {args.output} ({args.width}x{args.height})")
        if args.full:
            tall = states[1 if args.open else 0]["height"]
            screenshot(browser, shown, args.full, args.width, tall)
            print(f"wrote {args.full} ({args.width}x{tall}, the whole page)")
    return 0 if _report(states) else 1


if __name__ == "__main__":
    raise SystemExit(main())
