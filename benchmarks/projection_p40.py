"""Against a published table no one here made: the source template's 4 x Tesla P40 results (shared/SEED_DIGEST.md,
table A: ResNet-50 at 224x224 on CIFAR-10, global batch 128, 5 epochs, fp32). Calibrate on its single-GPU fp32
row, predict the 4-GPU times of every method the projection covers on the p40-pcie3 profile (PCIe gen3 x16),
and print predicted vs published with the error (markdown, for docs/projection.md):

    PYTHONPATH=src python benchmarks/projection_p40.py

Nothing here is measured on this machine: the inputs are the table's numbers, the model's counted FLOPs and
shapes, and the hardware profile.
"""

from __future__ import annotations

import math

from stratbench.core.config import TrainConfig
from stratbench.measuring.hardware import builtin
from stratbench.measuring.records import RunRecord
from stratbench.predicting.projection import calibrate, project

# Table A (shared/SEED_DIGEST.md): method -> (stratbench strategy, options, optimizer, published seconds for 5 epochs)
EPOCHS, TRAIN_IMAGES, BATCH = 5, 50_000, 128
STEPS = EPOCHS * math.ceil(TRAIN_IMAGES / BATCH)  # 1955 optimizer steps
SINGLE_S = 1979.0
ROWS = [
    ("4 GPU nn.DataParallel (#4)", "dp", {}, "sgd", 742.0),
    ("4 GPU DDP (#5)", "ddp", {}, "sgd", 560.0),
    ("accelerate DDP (#6)", "accelerate-ddp", {}, "sgd", 569.0),
    ("PyTorch FSDP, Linear+Conv2d units (#7)", "fsdp1", {}, "sgd", 581.0),
    ("accelerate FSDP (#8)", "accelerate-fsdp", {}, "sgd", 576.0),
    ("DDP + ZeroRedundancyOptimizer, Adam (#9)", "ddp-zero", {}, "adamw", 596.0),
]


def spearman(a: list[float], b: list[float]) -> float:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from projection_check import spearman as rho

    return rho(a, b)


def base(strategy: str = "single", optimizer: str = "sgd", **kw) -> TrainConfig:
    return TrainConfig(
        model="resnet50", image_size=224, num_classes=10, data="synthetic", batch_size=BATCH, precision="fp32",
        optimizer=optimizer, strategy=strategy, **kw,
    )  # fmt: skip


def main() -> None:
    system = builtin().system("p40-pcie3")
    single_step = SINGLE_S / STEPS
    result = {  # the table's single-GPU fp32 row as a result.json
        "status": "ok", "world_size": 1, "config": base().to_dict(),
        "environment": {"device_type": "cuda", "gpus": ["Tesla P40"]},
        "metrics": {"step_time_median_s": single_step},
    }  # fmt: skip
    cal = calibrate([RunRecord.from_dict(result)], system, ["table A row 1 (1 GPU fp32, 1979 s)"])
    c = cal["fp32"]
    print(f"calibration: {STEPS} steps, {single_step * 1e3:.1f} ms/step -> {c.efficiency:.1%} of the P40's "
          f"{system.gpu.peak('fp32') / 1e12:.2f} TFLOP/s fp32")  # fmt: skip
    print()
    print(
        "| method (table A) | stratbench method | predicted s/step | predicted 5 epochs | published | error | comm/step (exposed) | dominant |"
    )
    print("|---|---|---|---|---|---|---|---|")
    errors, pairs = [], []
    for label, strategy, options, opt, published in ROWS:
        cfg = base(strategy, opt, strategy_options=options)
        p = project(cfg, system, nodes=1, gpus_per_node=4, calibration=cal, memory=False)
        if p.status != "ok":
            print(f"| {label} | {strategy} | {p.status} | - | {published:.0f} s | - | - | {p.reason} |")
            continue
        total = p.step_s * STEPS
        err = total / published - 1
        errors.append(abs(err))
        pairs.append((total, published))
        print(
            f"| {label} | {strategy} | {p.step_s * 1e3:.0f} ms | {total:.0f} s | {published:.0f} s | {err:+.1%} | "
            f"{p.comm_s * 1e3:.1f} ms ({p.comm_exposed_s * 1e3:.1f} ms) | {p.dominant} |"
        )
    print()
    print(f"median absolute error over {len(errors)} methods: {sorted(errors)[len(errors) // 2]:.1%} "
          f"(max {max(errors):.1%}); Spearman rank correlation predicted vs published: "
          f"{spearman([a for a, _ in pairs], [b for _, b in pairs]):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
