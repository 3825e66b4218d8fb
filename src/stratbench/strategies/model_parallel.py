"""``model-parallel``: one process, the model's stages on different GPUs (stage k on cuda:k), each batch
passing through them one after the other: the source's "naive" model parallelism. Only one GPU works at a
time (the bubble is (N-1)/N of each step); what it buys is memory: each GPU holds only its stages' weights,
gradients and optimizer state. The pipeline strategy is the multi-process, micro-batched form.

The split is ``stratbench.models.split``'s (``--balance``, ``--split-points``, shared with pipeline). The
model object is kept whole: its piece modules are moved to their devices and a forward pre-hook on each
stage's first module moves the incoming activation there, so parameter names, state dicts and checkpoints are
exactly the single-device ones; the logits come back to the first GPU, where the loss and the labels are.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.models.split import BALANCE, FLATTEN, Split, split_model
from stratbench.strategies.base import CostModel, Strategy, register
from stratbench.strategies.costs import RankMemory, lean_refusal
from stratbench.strategies.parallel.pipeline_parallel import sample_of, spec_split


@dataclasses.dataclass(kw_only=True)
class ModelParallelOptions:
    """Options of the model-parallel strategy."""

    devices: int = 0
    """model-parallel: GPUs to spread the stages over, one stage each (0: every visible GPU)."""
    balance: str = "params"
    """Balance the automatic split by parameters (memory) or flops (forward+backward time)."""
    split_points: str = ""
    """Explicit split, comma-separated pieces where a stage begins, e.g. layer2,layer4 (see the printed split for the pieces)."""

    def __post_init__(self) -> None:
        if self.balance not in BALANCE:
            raise ConfigError(f"unknown balance {self.balance!r}; choose one of: {', '.join(BALANCE)}")
        if not isinstance(self.devices, int) or self.devices < 0 or self.devices == 1:
            raise ConfigError(f"devices must be >= 2 (or 0 for every visible GPU), got {self.devices!r}")

    @property
    def points(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.split_points.split(",") if p.strip())


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place_stages(model: nn.Module, split: Split, devices: list[torch.device]) -> list:
    """Move each stage's modules to its device and hook the stage's first module to move its input there;
    the model's output goes back to ``devices[0]``. Returns the hook handles."""
    if len(devices) != len(split.stages):
        raise ConfigError(f"{len(split.stages)} stages for {len(devices)} devices")
    placed: set[int] = set()
    handles = []
    for stage, device in zip(split.stages, devices, strict=True):
        names = [n for n in stage.modules if n != FLATTEN]
        for name in names:
            module = model.get_submodule(name)
            module.to(device)
            placed.update(id(p) for p in module.parameters())
            placed.update(id(b) for b in module.buffers())

        def to_device(_module, args, device=device):
            return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)

        handles.append(model.get_submodule(names[0]).register_forward_pre_hook(to_device))
    stray = [n for n, p in model.named_parameters() if id(p) not in placed]
    if stray:
        raise ConfigError(f"model-parallel: parameters outside every stage: {', '.join(stray[:3])}")
    first = devices[0]
    handles.append(model.register_forward_hook(lambda _m, _a, out: out.to(first)))
    return handles


class ModelParallelCost(CostModel):
    """The stages of one model on several GPUs of one process: the busiest GPU's states; no collectives."""

    @classmethod
    def memory_model(cls, ctx, rank):
        """The most loaded GPU: its stages' parameters, gradients and optimizer state."""
        n = ModelParallelStrategy.n_devices(ctx.options) or 2
        split = spec_split(ctx.cfg, n, ctx.options)
        local = max(s.params for s in split.stages)
        pd = ctx.param_bytes
        m = RankMemory(params=local * pd, grads=local * pd, optim=ctx.flat_optim_bytes(local))
        m.sharding_note = f"the largest of {n} stages (one per GPU)"
        return m

    @classmethod
    def comm_model(cls, ctx):
        return []  # device-to-device copies inside one process, no collective


@register
class ModelParallelStrategy(Strategy):
    name = "model-parallel"
    splits_model = True
    description = "one process, the model's stages on different GPUs (cuda:0, cuda:1, ...), no micro-batches"
    requirements = ">= 2 CUDA GPUs, one process"
    launcher = "python"
    Options = ModelParallelOptions

    @classmethod
    def n_devices(cls, options: ModelParallelOptions) -> int:
        return options.devices or _cuda_count()

    @classmethod
    def lora_refusal(cls, cfg) -> str | None:
        if cfg.lora_rank:
            return "--lora-rank with model-parallel is not supported (untested: it needs 2 CUDA GPUs); use single or ddp"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        found = _cuda_count()
        if found < 2:
            return f"needs >= 2 CUDA GPUs, found {found}"
        if device.type != "cuda":
            return f"needs the cuda device; --device is {cfg.device!r}"
        if world_size != 1:
            return f"model-parallel runs in one process that drives every GPU; it was started with world size {world_size}"
        options = cls.parse_options(cfg.strategy_options)
        if options.devices > found:
            return f"--devices {options.devices}: only {found} CUDA GPUs are visible"
        if why := cls.lora_refusal(cfg):
            return why
        if cfg.compile or cfg.activation_checkpointing:
            return "--compile and --activation-checkpointing are not supported by model-parallel"
        if why := lean_refusal(cfg, "its memory model prices a stage's states per element"):
            return why
        try:
            spec_split(cfg, cls.n_devices(options), options)
        except ConfigError as exc:
            return str(exc)
        return None

    @classmethod
    def data_parallel_size(cls, cfg, world_size: int) -> int:
        return 1

    cost = ModelParallelCost

    def devices(self) -> list[torch.device]:
        n = self.n_devices(self.options)
        first = self.env.device.index or 0
        return [torch.device("cuda", (first + k) % _cuda_count()) for k in range(n)]

    def move(self, model: nn.Module) -> nn.Module:
        shape, tokens = sample_of(self.cfg)
        devices = self.devices()
        self.split = split_model(
            model,
            len(devices),
            balance=self.options.balance,
            split_points=list(self.options.points),
            sample_shape=shape,
            tokens=tokens,
            name=self.cfg.model,
        )
        if self.env.is_main:
            print("\n".join(self.split.lines()).replace("pipeline split", "model-parallel split"), flush=True)
        self.handles = place_stages(model, self.split, devices)
        return model

    def memory_devices(self) -> list[torch.device]:
        return self.devices()

    def synchronize(self) -> None:
        for device in self.devices():
            torch.cuda.synchronize(device)

    def report(self):
        return {
            "model_parallel": {"devices": [str(d) for d in self.devices()], "split": self.split.to_dict()}
        }
