"""A picture of real torch.profiler traces, drawn by catapult's trace viewer (the viewer TensorBoard's PyTorch
profiler plug-in embeds) in headless Chromium, offline:

    python benchmarks/trace_render.py runs/trace_fsdp/traces out.png --polyfill webcomponents.min.js

Needs: ``chromium-headless-shell`` (Debian: apt-get install chromium-headless-shell), the plug-in's
``trace_viewer_full.html`` (pip install torch-tb-profiler; found through its package, or --viewer FILE), and the
v0 Web Components polyfill its HTML import needs (npm pack webcomponents.js@0.7.24: package/webcomponents.min.js;
the plug-in loads it from a CDN). The traces and the viewer are served from a temporary folder on 127.0.0.1;
the page (trace_view.html, next to this script) imports every rank's file into one timeline.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def plugin_viewer() -> Path | None:
    spec = importlib.util.find_spec("torch_tb_profiler")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "static" / "trace_viewer_full.html"
    return path if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", type=Path, help="a --profile run's OUTPUT/traces folder (rank*.json)")
    ap.add_argument("output", type=Path, help="the PNG to write")
    ap.add_argument("--polyfill", type=Path, required=True, help="webcomponents.min.js of webcomponents.js 0.7.24")
    ap.add_argument("--viewer", type=Path, default=None, help="trace_viewer_full.html (default: torch_tb_profiler's)")
    ap.add_argument("--browser", default="chromium-headless-shell")
    ap.add_argument("--size", default="1800,1020", help="window width,height in pixels")
    args = ap.parse_args(argv)
    viewer = args.viewer or plugin_viewer()
    if viewer is None or not viewer.is_file():
        sys.exit("no trace_viewer_full.html: pip install torch-tb-profiler, or pass --viewer FILE")
    ranks = sorted(args.traces.glob("rank*.json"))
    if not ranks:
        sys.exit(f"no rank*.json trace in {args.traces}")
    browser = shutil.which(args.browser)
    if browser is None:
        sys.exit(f"{args.browser} not found (Debian: apt-get install chromium-headless-shell)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for src in (viewer, args.polyfill, HERE / "trace_view.html", *ranks):
            shutil.copy(src, root / src.name)
        handler = functools.partial(_Quiet, directory=str(root))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{server.server_port}/trace_view.html?files={','.join(p.name for p in ranks)}"
            cmd = [browser, "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={args.size}",
                   "--virtual-time-budget=60000", f"--screenshot={args.output.resolve()}", url]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        finally:
            server.shutdown()
    print(f"wrote {args.output} ({', '.join(p.name for p in ranks)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
