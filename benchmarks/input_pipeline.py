"""Input-pipeline throughput alone (no model): CIFAR-10 training batches, loader vs device pipeline, 32 and 224 px.

Each measurement makes ``--batches`` training batches of ``--batch-size`` after 2 warm-up batches and reads a
synchronised clock when the last batch is on the training device (the loader's batches are copied there as
the engine does: pinned memory + non_blocking on CUDA). Repeated ``--repeats`` times; min/median/max samples/s.
The transforms are those of ``stratbench.data.datasets._cifar10`` (loader: per-image PIL RandomCrop(32, padding=4),
RandomHorizontalFlip, Resize, ToTensor, Normalize in DataLoader workers; device: ``stratbench.data.device``).
Without ``--cifar-dir`` the images are random pixels in CIFAR-10's format (the transforms' cost does not
depend on pixel values).

    PYTHONPATH=src python benchmarks/input_pipeline.py                       # CPU, both pipelines, 32 and 224 px
    PYTHONPATH=src python benchmarks/input_pipeline.py --device cuda --workers 0 4 8 --output report.md
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from stratbench.core.config import TrainConfig
from stratbench.data.datasets import build_data, make_train_batches, pipeline_of


def write_fake_cifar(root: Path, n_train: int, n_test: int = 100, seed: int = 0) -> Path:
    """Random uint8 images in the real cifar-10-batches-py layout (5 training batches, a test batch, meta)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def batch(n: int) -> dict:
        return {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, n).tolist(),
        }

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(n_train // 5)))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(n_test)))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))
    return root


def skip_cifar_md5() -> None:
    """torchvision md5-checks the real archive's files; generated files need the check skipped."""
    from stratbench.core.torchvision_compat import import_torchvision

    tv = import_torchvision()
    tv.datasets.CIFAR10._check_integrity = lambda self: True
    tv.datasets.cifar.check_integrity = lambda *a, **k: True


def measure(
    cfg: TrainConfig, device: torch.device, batch: int, batches: int, repeats: int
) -> tuple[str, list[float]]:
    """samples/s of each repeat, and the pipeline that ran."""
    bundle = build_data(cfg)
    train, sampler = make_train_batches(cfg, bundle, device, 0, 1, batch)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates = []
    for r in range(repeats):
        sampler.set_epoch(r)
        it = iter(train)
        for _ in range(2):  # warm-up: worker start, first allocations, kernel selection
            x, y = next(it)
            x = x.to(device, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(batches):
            x, y = next(it)
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
        sync()
        rates.append(batches * batch / (time.perf_counter() - t0))
        del it
    return pipeline_of(train), rates


def versions() -> str:
    import stratbench
    from stratbench.core.torchvision_compat import import_torchvision

    tv = import_torchvision()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"CPU {cpu}, {os.cpu_count()} cores visible, torch threads {torch.get_num_threads()}; GPU {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, torchvision {tv.__version__}, "
        f"stratbench {getattr(stratbench, '__version__', '?')}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 224])
    ap.add_argument("--pipelines", nargs="+", default=["loader", "device"], choices=["loader", "device"])
    ap.add_argument(
        "--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers (loader pipeline)"
    )
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--batches", type=int, default=20, help="timed batches per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-train", type=int, default=10000, help="generated training images (no --cifar-dir)")
    ap.add_argument("--cifar-dir", help="a folder holding the real cifar-10-batches-py")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own choice)")
    ap.add_argument("--output", help="also write the markdown table to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )

    with tempfile.TemporaryDirectory() as tmp:
        root = args.cifar_dir
        if root is None:
            root = str(write_fake_cifar(Path(tmp), args.n_train))
            skip_cifar_md5()
        rows = []
        for size in args.sizes:
            for pipe in args.pipelines:
                for workers in args.workers if pipe == "loader" else [0]:
                    cfg = TrainConfig(data="cifar10", data_dir=root, image_size=size, data_pipeline=pipe,
                                      num_workers=workers, seed=0)  # fmt: skip
                    used, rates = measure(cfg, device, args.batch_size, args.batches, args.repeats)
                    assert used == pipe, (used, pipe)
                    rows.append((size, pipe, workers if pipe == "loader" else "-", rates))
                    print(f"{size:>4}px {pipe:<6} workers {rows[-1][2]}: "
                          f"{' '.join(f'{r:.0f}' for r in rates)} samples/s", file=sys.stderr, flush=True)  # fmt: skip
    lines = [
        f"device {device.type}; batch {args.batch_size}; {args.batches} timed batches x {args.repeats} repeats; "
        f"data {'CIFAR-10 at ' + str(args.cifar_dir) if args.cifar_dir else f'{args.n_train} random CIFAR-format images'}",
        versions(),
        f"load average (1 min) before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}",
        "",
        "| image size | pipeline | loader workers | samples/s min | median | max |",
        "|---|---|---|---|---|---|",
    ]
    for size, pipe, workers, rates in rows:
        lines.append(
            f"| {size} | {pipe} | {workers} | {min(rates):.0f} | {statistics.median(rates):.0f} | {max(rates):.0f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
