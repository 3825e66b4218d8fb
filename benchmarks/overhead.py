"""How much does stratbench's loop cost per step over a minimal hand-written PyTorch loop?

Both run in this one process, on the same model, data, optimizer and device, alternating (hand, stratbench,
hand, stratbench, ...) so that drift of the machine hits both alike. Each reports per-step times from a
synchronised clock with the first ``--warmup`` steps left out; the ratio of medians is printed.

    .venv/bin/python benchmarks/overhead.py                      # resnet18, 32x32 synthetic, batch 64, CPU
    .venv/bin/python benchmarks/overhead.py --model resnet50 --image-size 224 --batch-size 128 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.data.datasets import build_data
from stratbench.models.zoo import build_model
from stratbench.training import engine


def hand_loop(cfg: TrainConfig, device: torch.device) -> list[float]:
    """The minimal loop a user would write: DataLoader, forward, loss, backward, step."""
    torch.manual_seed(cfg.seed)
    data = build_data(cfg)
    model = build_model(cfg.model, data.num_classes, cifar_stem=cfg.cifar_stem).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    loader = torch.utils.data.DataLoader(data.train, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: list[float] = []
    it = iter(loader)
    model.train()
    for _ in range(cfg.max_steps or 0):
        sync()
        t0 = time.perf_counter()
        x, y = next(it)
        x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    return times[cfg.timing_warmup_steps :]


def stratbench_loop(cfg: TrainConfig) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        result = engine.run(cfg.replace(output=out))
    m = result["metrics"]
    return [m["step_time_median_s"]] * m["measured_steps"]  # the loop reports its own statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu"))
    cfg = TrainConfig(
        model=args.model,
        cifar_stem=False,
        data="synthetic",
        image_size=args.image_size,
        synthetic_samples=args.batch_size * (args.steps + 1),
        batch_size=args.batch_size,
        epochs=1,
        max_steps=args.steps,
        lr_schedule="constant",
        timing_warmup_steps=args.warmup,
        strategy="single",
        precision="fp32",
        device=device.type,
        eval_every_epoch=False,
        save_every_epoch=False,
        measure_flops=False,
    )
    hand, ours = [], []
    for r in range(args.repeats):
        h = statistics.median(hand_loop(cfg, device))
        s = statistics.median(stratbench_loop(cfg))
        hand.append(h)
        ours.append(s)
        print(f"repeat {r + 1}: hand-written {h * 1e3:.1f} ms/step, stratbench {s * 1e3:.1f} ms/step, ratio {s / h:.3f}")
    h, s = statistics.median(hand), statistics.median(ours)
    print(
        f"\n{args.model} {args.image_size}x{args.image_size} batch {args.batch_size} on {device.type} "
        f"({torch.get_num_threads()} threads), median of {args.repeats} repeats x {args.steps - args.warmup} steps:\n"
        f"  hand-written loop : {h * 1e3:.2f} ms/step\n  stratbench single : {s * 1e3:.2f} ms/step\n"
        f"  overhead          : {(s / h - 1) * 100:+.2f}%  (target <= +3%)"
    )


if __name__ == "__main__":
    main()
