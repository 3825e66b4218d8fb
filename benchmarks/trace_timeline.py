"""Draw the phases and collectives of stratbench's per-rank profiler traces (--profile) as one timeline PNG.

    python benchmarks/trace_timeline.py RUN/traces OUT.png      # rank*.json or rank*.json.gz in the folder

A CUDA trace gets a third lane per rank, the GPU's kernels, so that where the GPU sits idle inside the step shows
(benchmarks/gpu_h200_2026-11-26/trace_fast_b256.png).

One lane per rank for the step's phases (the ``phase:*`` ranges the loop records) and one below it for the
collectives the backend ran (``gloo:*`` / ``nccl:*`` events, on its worker thread): where the communication
sits inside the step, and how the two ranks line up. The same files open in https://ui.perfetto.dev and in
TensorBoard's profiler plug-in.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"data": "#937860", "forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
COMM = "#c44e52"
KERNEL = "#8172b3"
GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _rank(path: Path) -> int:
    return int(path.name.split(".")[0][4:])


def main(traces: Path, out: Path) -> None:
    files = sorted(list(traces.glob("rank*.json")) + list(traces.glob("rank*.json.gz")), key=_rank)
    ranks = [_events(f) for f in files]
    gpu = any(e.get("cat") in GPU_CATS for ev in ranks for e in ev)
    lanes = 3 if gpu else 2
    t0 = min(float(e["ts"]) for ev in ranks for e in ev if e.get("name", "").startswith("phase:"))
    fig, ax = plt.subplots(figsize=(13, 1.2 + 0.55 * lanes * len(ranks)), dpi=110)
    labels, ys = [], []
    for r, ev in enumerate(ranks):
        y = r * 1.1 * lanes
        for e in ev:
            name, dur = e.get("name", ""), float(e.get("dur", 0) or 0)
            if e.get("ph") != "X" or not dur:
                continue
            x = (float(e["ts"]) - t0) / 1000
            if name.startswith("phase:") and e.get("cat") != "gpu_user_annotation":
                ax.broken_barh([(x, dur / 1000)], (y + 1.0, 0.8), color=COLOURS.get(name[6:], "#999"))
            elif name.startswith(("gloo:", "nccl:")):
                ax.broken_barh([(x, dur / 1000)], (y, 0.8), color=COMM)
            elif gpu and e.get("cat") in GPU_CATS:
                ax.broken_barh([(x, dur / 1000)], (y + 2.0, 0.8), color=KERNEL)
        labels += [f"rank {r}: collectives", f"rank {r}: phases (host)"] + ([f"rank {r}: GPU kernels"] if gpu else [])
        ys += [y + 0.4, y + 1.4] + ([y + 2.4] if gpu else [])
    ax.set_yticks(ys, labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first traced phase", fontsize=9)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()] + [Patch(color=COMM, label="collective")]
    handles += [Patch(color=KERNEL, label="GPU kernel")] if gpu else []
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"stratbench --profile trace: {traces}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
