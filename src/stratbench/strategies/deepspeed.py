"""DeepSpeed: ZeRO stages 0-3 with optional CPU offload, driven by stratbench's own loop, data and options.

The DeepSpeed config is generated from stratbench's options (micro-batch, accumulation, clipping, precision,
ZeRO stage, offload) so that the same command line trains the same problem as every other method; a user's
JSON is merged in and every disagreement with stratbench's options is a clear error before any work starts.

Two things make it run out of the box where the source template never did:
- no JIT compilation by default: the client optimizer is a plain torch optimizer; FusedAdam / DeepSpeedCPUAdam
  are built only when asked for (``--ds-optimizer``), in ``setup``, before the first timed step.
- DeepSpeed's CPU shared-memory communication op (a ~40 s compile on first use) is only used by
  ``inference_all_reduce``; training collectives go through torch.distributed. stratbench marks the op as
  unavailable before DeepSpeed's communication backend is created, so it is never built.

``deepspeed`` is imported lazily: this module is imported by ``stratbench list`` and at CLI start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import checkpoint
from stratbench.core.config import TrainConfig
from stratbench.core.errors import CheckpointError, ConfigError
from stratbench.core.precision import Precision
from stratbench.measuring.comm import Collective, ceil_to
from stratbench.measuring.model_trace import ModelSpec
from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, register
from stratbench.strategies.costs import DS_PARAM_PERSISTENCE, DS_PREFETCH_BUCKET, DS_REDUCE_BUCKET, RankMemory
from stratbench.strategies.deepspeed_config import autotp_degree, build_ds_config, load_user_json
from stratbench.strategies.op_builds import prepare_op_builds
from stratbench.strategies.tp import (
    BLOCKS_ONLY,
    LocalSlice,
    local_flop_share,
    model_plan,
    tp_shapes,
)
from stratbench.strategies.tp import unsupported as tp_unsupported

DS_OPTIMIZERS = ("torch", "fused", "cpu-adam")
DS_TAG = "deepspeed"
"""Tag (sub-folder) DeepSpeed writes its files under inside a stratbench checkpoint folder."""


@dataclasses.dataclass(kw_only=True)
class DeepSpeedZeroOptions:
    """The ZeRO options deepspeed and accelerate-deepspeed share."""

    zero_stage: int | None = None
    """ZeRO stage 0-3: 1 shards optimizer state, 2 also gradients, 3 also parameters (default: 2, or the stage in --deepspeed-config)."""
    offload_optimizer: str | None = None
    """ZeRO-Offload of optimizer state and step: none, cpu or nvme (default: none, or the device in --deepspeed-config)."""
    offload_params: str | None = None
    """ZeRO-3 only: offload parameters: none, cpu or nvme (default: none, or the device in --deepspeed-config)."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON merged into the generated config; its conflicts with stratbench's options are errors."""
    reduce_bucket_size: int | None = None
    """Elements of ZeRO's gradient reduce bucket, which stages 1-3 allocate whole (DeepSpeed's default 5e8: 1.86 GiB in fp32, whatever the model's size): lower it for small models."""
    nvme_path: str | None = None
    """Folder for --offload-optimizer/--offload-params nvme (ZeRO-Infinity, ZeRO-3 only; needs DeepSpeed's async_io op, i.e. libaio)."""


@dataclasses.dataclass(kw_only=True)
class DeepSpeedOptions(DeepSpeedZeroOptions):
    """Options of the deepspeed strategy."""

    ds_optimizer: str = "torch"
    """torch (plain torch optimizer, no compilation), fused (DeepSpeed FusedAdam) or cpu-adam (DeepSpeedCPUAdam); the last two JIT-compile a kernel once and need --optimizer adamw."""
    autotp_size: int = 1
    """DeepSpeed AutoTP training (tensor_parallel.autotp_size): split each block's attention and MLP matrices over T consecutive ranks, which read the same batches (data-parallel size world / T); 1: off."""


def autotp_partition_config(model: nn.Module) -> dict[str, Any]:
    """AutoTP's ``partition_config`` for ``model``, read from its tensor-parallel plan (``tp.model_plan``, blocks
    only: the embedding and the head stay whole): a column-parallel Linear's weight split over its outputs, a
    row-parallel one's over its inputs (its output all-reduced). Only these are split; DeepSpeed leaves every
    weight no spec matches whole, so its name heuristics never guess at a model it does not know."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kinds = {ColwiseParallel: "column", RowwiseParallel: "row"}
    specs: dict[str, list[str]] = {"column": [], "row": []}
    for key, style in (model_plan(model) or {}).items():
        if type(style) in kinds:
            specs[kinds[type(style)]].append(fnmatch.translate(f"{key}.weight"))
    layer_specs = [{"patterns": p, "partition_type": kind} for kind, p in specs.items() if p]
    return {"use_default_specs": False, "layer_specs": layer_specs}


DS_TRACE_PRECISION = {"fp16-mixed": "fp16-true", "bf16-mixed": "bf16-true"}
"""The run's precision -> the one DeepSpeed's forward/backward runs in: its fp16/bf16 block casts the module."""


class _DeepSpeedPrecision(Precision):
    """The user's precision as DeepSpeed runs it: DeepSpeed casts the module (fp16/bf16 block, fp32 master
    weights in the optimizer) and scales the loss, so inputs follow the module's dtype and nothing autocasts."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(name, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=False)  # DeepSpeed's own dynamic loss scaler
        half = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
        self.input_dtype = half.get(name, torch.float32)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # fp16/bf16: DeepSpeed casts the module itself

    def convert_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.input_dtype) if x.is_floating_point() and x.dtype != self.input_dtype else x

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _avoid_shm_op_build() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory op (~40 s on first use).

    DeepSpeed builds it when its communication backend is created, but uses it only in
    ``inference_all_reduce``; training all-reduces go through torch.distributed (gloo/nccl) either way.
    ``deepspeed.ops.__compatible_ops__`` is one cached dict that DeepSpeed consults before building, so
    marking the op incompatible there skips the build. Must run before ``deepspeed.init_distributed``.
    """
    if (
        os.environ.get("STRATBENCH_DS_SHM_COMM", "0") == "1"
    ):  # opt back in (then cached in TORCH_EXTENSIONS_DIR)
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _kernel_unavailable(op_name: str) -> str | None:
    """None when DeepSpeed can JIT-build ``op_name`` here, else why not (checked before the run starts)."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package ships the binary)
        except ImportError:
            return f"building DeepSpeed's {op_name} kernel needs ninja (pip install ninja)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return f"building DeepSpeed's {op_name} kernel needs a C++ compiler"
    import deepspeed.ops

    if not deepspeed.ops.__compatible_ops__.get(op_name, False):
        return f"DeepSpeed reports its {op_name} kernel as not buildable on this machine (see `ds_report`)"
    return None


def _autotp_unsupported(cfg: TrainConfig, t: int) -> str | None:
    """Why the model cannot be split over AutoTP groups of ``t`` (tp's checks on its blocks-only plan), or None."""
    reason = tp_unsupported(cfg, t, "--autotp-size", BLOCKS_ONLY) if t > 1 else None
    return f"deepspeed --autotp-size {t}: {reason}" if reason else None


def _nvme_unavailable(zero: dict[str, Any]) -> str | None:
    """None unless an nvme offload is asked for that cannot run here: a missing folder, or DeepSpeed's async_io
    op (built from libaio's headers and library) not buildable on this machine."""
    nvme = [k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device") == "nvme"]
    if not nvme:
        return None
    path = Path(zero[nvme[0]]["nvme_path"])
    if not path.is_dir():
        raise ConfigError(f"--nvme-path {path} is not a folder")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    # DeepSpeed's own check: a test program calling io_submit compiles and links against -laio.
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return (
            "nvme offload needs DeepSpeed's async_io op, which cannot be built here: libaio's headers and library "
            "are missing (Debian/Ubuntu: apt-get install libaio-dev, which `make install` does as root; "
            "see `ds_report`)"
        )
    return _kernel_unavailable("async_io")


DS_PARAM_BUFFER_SIZE = 100_000_000
"""DeepSpeed's default offload_param.buffer_size (elements per parameter swap buffer, 5 buffers)."""


def size_nvme_param_buffers(zero: dict[str, Any], model: nn.Module, world_size: int) -> None:
    """--offload-params nvme: size the parameter swap buffers for this model where the JSON does not.

    DeepSpeed allocates ``buffer_count`` buffers of ``buffer_size`` elements up front, page-locked, in the
    weights' dtype: 5 x 1e8 by default, 2 GB per rank in fp32 whatever the model. Each buffer holds one
    parameter's partition, so the largest partition (ceil(numel / world)) is enough; DeepSpeed's default stays
    the ceiling, and a buffer_size in --deepspeed-config is kept as written."""
    block = zero.get("offload_param") or {}
    if block.get("device") != "nvme" or "buffer_size" in block:
        return
    largest = max((-(-p.numel() // world_size) for p in model.parameters()), default=1)
    block["buffer_size"] = min(DS_PARAM_BUFFER_SIZE, max(largest, 1))


def aligned_gradient_pieces(tensors, offsets, alignment: int, swappable) -> tuple[list, list]:
    """Split each swappable gradient ``tensor`` (placed at element ``offset`` of the flat partition) so that
    the piece DeepSpeed swaps starts at a multiple of ``alignment`` elements and spans a multiple of it; the
    head and tail stay in memory (DeepSpeed keeps pieces it does not swap as "unswapped gradients")."""
    new_tensors, new_offsets = [], []
    for tensor, offset in zip(tensors, offsets, strict=True):
        if not swappable(tensor):
            new_tensors.append(tensor)
            new_offsets.append(offset)
            continue
        head = min(-offset % alignment, tensor.numel())
        body = (tensor.numel() - head) // alignment * alignment
        for start, length in ((0, head), (head, body), (head + body, tensor.numel() - head - body)):
            if length:
                new_tensors.append(tensor.narrow(0, start, length))
                new_offsets.append(offset + start)
    return new_tensors, new_offsets


def _align_swapped_gradients() -> None:
    """--offload-optimizer nvme: make DeepSpeed swap only gradient pieces that start on an I/O boundary.

    DeepSpeed 0.19 swaps a sub-group's gradients to files per parameter (those of 1 MiB and more) and reads
    them back straight into the flat gradient buffer at the parameter's offset. Its async_io op opens files
    with O_DIRECT, which needs the memory address aligned too (512 bytes): a read into a misaligned address
    transfers nothing and still reports success. DeepSpeed aligns the lengths (``_adjust_for_misaligned_lengths``)
    but not the offsets, which are sums of the preceding parameters' sizes (tinynet's 64-element biases make
    them misaligned): the optimizer then stepped on stale buffer contents for that parameter (the loss 0.5%
    off from the second step). Installed once per process, for the run's lifetime."""
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper

    if getattr(OptimizerSwapper, "_stratbench_aligned_offsets", False):
        return

    def _adjust_for_misaligned_lengths(self, tensors, offsets):
        return aligned_gradient_pieces(
            tensors, offsets, self.numel_alignment, lambda t: self.is_swappable_tensor(tensor=t)
        )

    OptimizerSwapper._adjust_for_misaligned_lengths = _adjust_for_misaligned_lengths
    OptimizerSwapper._stratbench_aligned_offsets = True


@contextlib.contextmanager
def _zero_init_keeps_dtype():
    """Make ZeRO-3's parameter conversion keep the weights' dtype (deepspeed 0.19, ``zero.Init._set_dtype``).

    Given a dtype, it computes ``dtype or torch.float16 if fp16_supported() else torch.bfloat16 if
    is_bf16_supported else torch.float32``, which parses as ``(dtype or fp16) if ... else bf16``: on an
    accelerator without fp16 (the CPU) the given dtype is dropped for bf16. Only the parameter swapper reads it:
    under --offload-params nvme, an fp32 run's swapped partitions were bf16 buffers (files of 2 bytes an
    element, the loss 5e-5 off fp32 from the first step). The dtype given wins here, as its docstring says."""
    from deepspeed.runtime.zero import partition_parameters as pp

    cls = pp.InsertPostInitMethodToModuleSubClasses
    original = cls._set_dtype

    def _set_dtype(self, ds_config, dtype):
        original(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    cls._set_dtype = _set_dtype
    try:
        yield
    finally:
        cls._set_dtype = original


def autotp_view(ctx):
    """(the context one AutoTP rank's ZeRO sees, the degree T): its parameters are 1/T of each split matrix plus
    the whole replicated rest, and ZeRO partitions them over the data-parallel group, world / T."""
    t = ctx.options.autotp_size
    if t == 1:
        return ctx, 1
    numels = tp_shapes(ModelSpec.from_config(ctx.cfg)).local_numels(t)
    return dataclasses.replace(ctx, info=dataclasses.replace(ctx.info, numels=numels), world=ctx.world // t), t


def autotp_comm(ctx, view, zero: dict[str, Any], t: int) -> list[Collective]:
    """AutoTP's traffic (measured on deepspeed 0.19, docs/deepspeed_accelerate.md), on the data-parallel
    replica's micro-batch of (b, s, dim) activations in the dtype DeepSpeed runs the model in: forward, each
    row-parallel Linear's output all-reduced over the AutoTP group (RowParallel); backward, each column-parallel
    Linear's input gradient all-reduced (ColumnParallel): q, k, v and gate, up each their own, 5 per block where
    Megatron sums the attention's and the MLP's once (2). The gradient norm is summed over the AutoTP group
    (ZeRO 1-2's overflow/norm check, or clipping). On a data-parallel group of one rank DeepSpeed still calls its
    gradient all-reduce and norm all-reduce there (no bytes move); a larger one is ``deepspeed_comm``'s."""
    shapes = tp_shapes(ModelSpec.from_config(ctx.cfg))
    cfg, bit, dp = ctx.cfg, 2 if ctx.half else ctx.param_bytes, view.world
    act = cfg.batch_size // (dp * cfg.grad_accum) * cfg.seq_len * shapes.transformer.dim * bit
    weights = [d for n, d in zip(shapes.names, shapes.split, strict=True) if n.endswith(".weight")]
    row, col = weights.count(1) * cfg.grad_accum, weights.count(0) * cfg.grad_accum
    rows = [
        Collective("all_reduce", row * act, row, "forward", t, "row-parallel outputs (RowParallel)"),
        Collective(
            "all_reduce", col * act, col, "backward", t, "column-parallel input gradients, one per layer"
        ),
    ]
    stage = int(zero.get("stage", 2))
    norm = stage >= 1 or bool(cfg.clip_grad_norm)
    if norm:
        rows.append(Collective("all_reduce", 4, 1, "optimizer", t, "gradient norm over the AutoTP group"))
    if dp > 1:
        return rows + deepspeed_comm(view, zero)
    rows.append(
        Collective("all_reduce", view.info.total * bit, 1, "backward", 1, "gradients, 1-rank dp group")
    )
    if norm:
        rows.append(Collective("all_reduce", 4, 1, "optimizer", 1, "gradient norm, 1-rank dp group"))
    return rows


AUTOTP_WEIGHTS = "autotp_model_whole.pt"
"""File (in a checkpoint folder of an --autotp-size run) with the whole model: DeepSpeed saves each AutoTP rank's
slices (mp_rank_XX files), which its zero_to_fp32 does not merge."""


def autotp_size_of(ds_config: dict[str, Any]) -> int:
    return int((ds_config.get("tensor_parallel") or {}).get("autotp_size") or 1)


@contextlib.contextmanager
def _autotp_whole(module: nn.Module):
    """Every AutoTP-split weight of ``module`` whole for the block (DeepSpeed's GatherReplacedLayerParams per
    replaced layer: an all-gather over the AutoTP group, on every rank), split again from its (possibly loaded)
    values on the way out."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    with contextlib.ExitStack() as stack:
        for layer in module.modules():
            params = list(layer.parameters(recurse=False))
            if params:
                stack.enter_context(GatherReplacedLayerParams(params, layer, enabled=True))
        yield


class DeepSpeedCost(CostModel):
    """DeepSpeed's ZeRO stage, offload and buckets, read from the config the run would build
    (``deepspeed_memory``, ``deepspeed_comm``, ``deepspeed_overlap``); under --autotp-size T, over one AutoTP
    rank's slice of the model and the data-parallel group (``autotp_view``), plus Megatron's traffic."""

    @classmethod
    def memory_model(cls, ctx, rank):
        ds = build_ds_config(ctx.cfg, ctx.options, ctx.world)
        block = ds.get("optimizer")
        if block is not None:  # the JSON's optimizer, not --optimizer, decides the optimizer state
            sgd = block["type"].lower() == "sgd"
            momentum = float(block["params"].get("momentum", 0.0)) if sgd else ctx.cfg.momentum
            cfg = ctx.cfg.replace(optimizer="sgd" if sgd else "adamw", momentum=momentum)
            ctx = dataclasses.replace(ctx, cfg=cfg)
        view, t = autotp_view(ctx)
        m = deepspeed_memory(view, ds["zero_optimization"])
        if t > 1:
            m.data_ranks, m.trace_transform = view.world, LocalSlice(t)
            m.sharding_note += f", AutoTP: block matrices 1/{t}, embedding, norms and head whole"
        return m

    @classmethod
    def comm_model(cls, ctx):
        view, t = autotp_view(ctx)
        zero = build_ds_config(ctx.cfg, ctx.options, ctx.world)["zero_optimization"]
        return autotp_comm(ctx, view, zero, t) if t > 1 else deepspeed_comm(view, zero)

    @classmethod
    def comm_overlap(cls, ctx) -> float:
        """Share of forward/backward traffic that can run under compute (stratbench.predicting.projection): none without
        ``overlap_comm`` (stages 0-2 by default: gradients are reduced inside backward's hooks, or after it)."""
        return deepspeed_overlap(build_ds_config(ctx.cfg, ctx.options, ctx.world)["zero_optimization"])

    @classmethod
    def compute_scale(cls, ctx) -> float:
        """1, or under --autotp-size T an AutoTP rank's share of its replica's FLOPs (``tp.local_flop_share``)."""
        t = ctx.options.autotp_size
        return local_flop_share(ModelSpec.from_config(ctx.cfg), t) if t > 1 else 1.0


class DeepSpeedCheckpointIO(CheckpointIO):
    """DeepSpeed's own (sharded) engine checkpoint plus stratbench's header; full state dicts gathered from
    ZeRO-3's partitions; weights of any other layout through --init-from only."""

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full fp32-or-native model state on CPU; under ZeRO-3 every rank gathers the partitions (a collective)."""
        module = self.strategy.unwrap(model)
        if self.strategy._stage() == 3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        else:
            gathered = contextlib.nullcontext()
        tp_whole = (
            _autotp_whole(module) if autotp_size_of(self.strategy.ds_config) > 1 else contextlib.nullcontext()
        )
        with gathered, tp_whole:
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def save_checkpoint(self, path: Path, model: nn.Module, optimizer, extra: dict) -> Path:
        """DeepSpeed's own (sharded) checkpoint plus stratbench's header, swapped into place atomically."""
        strategy = self.strategy
        assert strategy.engine is not None
        return save_engine_checkpoint(strategy, strategy.engine, Path(path), strategy.ds_config, extra)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer) -> dict:
        """Resume from a DeepSpeed checkpoint of the same world size and stage; weights of other layouts load
        only through --init-from (their optimizer state cannot be mapped onto ZeRO's partitions)."""
        strategy, engine = self.strategy, self.strategy.engine
        assert engine is not None
        path = Path(path)
        meta = checkpoint.read_meta(path)
        if meta.get("layout") != "deepspeed":
            if optimizer is not None:
                raise CheckpointError(
                    f"deepspeed resumes only from its own checkpoints; {path} has layout {meta.get('layout')!r}: "
                    "start from its weights with --init-from instead"
                )
            state = checkpoint.load_any(path)
            self._load_weights(state["model"])
            return state
        world, stage, t = strategy.env.world_size, strategy._stage(), autotp_size_of(strategy.ds_config)
        if (meta.get("world_size"), meta.get("zero_stage"), meta.get("autotp_size", 1)) != (world, stage, t):
            raise CheckpointError(
                f"{path} was saved by deepspeed with world size {meta.get('world_size')}, ZeRO stage "
                f"{meta.get('zero_stage')} and --autotp-size {meta.get('autotp_size', 1)}; this run has world size "
                f"{world}, stage {stage} and --autotp-size {t}. "
                f"Run `stratbench consolidate {path} FILE` and start with --init-from FILE"
            )
        saved = (meta.get("scheduler") or {}).get("deepspeed_scheduler")
        ours = type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None
        if saved != ours:

            def name(kind: str | None) -> str:
                return f"DeepSpeed's {kind}" if kind else "stratbench's"

            raise CheckpointError(
                f"{path} was trained with {name(saved)} LR schedule, this run uses {name(ours)}: resume with the "
                "same --deepspeed-config scheduler block, or start from its weights with --init-from"
            )
        # DeepSpeed's loader unpickles with weights_only=False: every file is checked weights-only first.
        tag = checkpoint.check_tag(path, meta.get("deepspeed_tag", DS_TAG))
        _refuse_nvme_checkpoint(path, tag)
        checkpoint.check_folder(path)
        load_path, _ = engine.load_checkpoint(
            str(path),
            tag=tag,
            load_optimizer_states=optimizer is not None,
            load_lr_scheduler_states=engine.lr_scheduler is not None,
        )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {path}")
        if engine.lr_scheduler is not None:
            _apply_scheduler_lr(engine.lr_scheduler)
        return meta

    def _load_weights(self, state: dict[str, torch.Tensor]) -> None:
        module = self.strategy.unwrap(self.strategy.engine)
        if autotp_size_of(self.strategy.ds_config) > 1:
            with _autotp_whole(module):  # every rank loads the whole weights, then keeps its slices
                module.load_state_dict(state)
        elif self.strategy._stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                if self.strategy.env.is_main:
                    module.load_state_dict(state)
        else:
            module.load_state_dict(state)


@register
class DeepSpeed(Strategy):
    name = "deepspeed"
    description = "DeepSpeed engine: ZeRO stages 0-3, optional CPU offload (ZeRO-Offload/ZeRO-Infinity)"
    Options = DeepSpeedOptions
    channels_last_weights = False  # flat/sharded parameters must be contiguous
    needs_process_group = True
    requirements = "pip install deepspeed; 1+ processes (CPU with gloo, or one GPU each)"
    launcher = "deepspeed"
    checkpoint_layout = "deepspeed"

    @classmethod
    def check_checkpoint(cls, path: Path, meta: dict[str, Any]) -> None:
        """An --offload-optimizer nvme checkpoint cannot be resumed or started from (``_refuse_nvme_checkpoint``)."""
        _refuse_nvme_checkpoint(path, checkpoint.check_tag(path, meta.get("deepspeed_tag", DS_TAG)))

    @classmethod
    def check_supported(cls, cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
        opts: DeepSpeedOptions = cls.parse_options(cfg.strategy_options)
        try:
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                return "needs the deepspeed package (pip install deepspeed)"
        except (ImportError, ValueError):
            return "needs the deepspeed package (pip install deepspeed)"
        if cfg.precision == "fp64":
            return (
                "DeepSpeed has no fp64 mode: its ZeRO optimizers keep fp32 master weights, gradient partitions and "
                "optimizer state whatever the weights' dtype (stage 0 refuses fp64 gradients); use fp32"
            )
        if cfg.precision in ("fp16-true", "bf16-true"):
            return (
                f"DeepSpeed keeps fp32 master weights; it has no {cfg.precision} mode (use "
                f"{cfg.precision.replace('-true', '-mixed')}, DeepSpeed's {cfg.precision[:4]} block)"
            )
        if opts.ds_optimizer not in DS_OPTIMIZERS:
            raise ConfigError(
                f"--ds-optimizer must be one of: {', '.join(DS_OPTIMIZERS)}; got {opts.ds_optimizer!r}"
            )
        ds = build_ds_config(cfg, opts, world_size)  # raises ConfigError on conflicts
        reason = _autotp_unsupported(cfg, opts.autotp_size) or _nvme_unavailable(ds["zero_optimization"])
        if reason:
            return reason
        user_block = bool(opts.deepspeed_config) and "optimizer" in load_user_json(opts.deepspeed_config)
        if opts.ds_optimizer != "torch" and not user_block and cfg.optimizer != "adamw":
            raise ConfigError(
                f"--ds-optimizer {opts.ds_optimizer} is an Adam kernel; it needs --optimizer adamw (got {cfg.optimizer})"
            )
        offloaded = "offload_optimizer" in ds["zero_optimization"]
        block = ds.get("optimizer")
        kernel = None
        if (
            block is not None
            and block["type"].lower() != "sgd"
            and not block["params"].get("torch_adam", False)
        ):
            # DeepSpeed's choice for a config Adam without torch_adam: DeepSpeedCPUAdam under ZeRO-Offload,
            # else FusedAdam (CUDA).
            kernel = "cpu_adam" if offloaded else "fused_adam"
        elif opts.ds_optimizer == "cpu-adam":
            kernel = "cpu_adam"
            if device.type == "cuda" and not offloaded:
                return "--ds-optimizer cpu-adam steps on the CPU: it needs --offload-optimizer cpu on a GPU"
        if kernel == "fused_adam" and device.type != "cuda":
            how = (
                'the JSON\'s optimizer block without "torch_adam": true'
                if user_block
                else "--ds-optimizer fused"
            )
            return (
                f'{how} means DeepSpeed\'s CUDA FusedAdam: it needs a GPU (on CPU set "torch_adam": true, or '
                "offload the optimizer for DeepSpeedCPUAdam)"
            )
        return _kernel_unavailable(kernel) if kernel else None

    @classmethod
    def data_parallel_size(cls, cfg: TrainConfig, world_size: int) -> int:
        """The replicas the batch is split over: world / --autotp-size (refused here when it does not divide)."""
        return world_size // autotp_degree(cls.parse_options(cfg.strategy_options), world_size)

    cost = DeepSpeedCost
    checkpoint_io_class = DeepSpeedCheckpointIO

    def data_shard(self) -> tuple[int, int]:
        """The rank's data-parallel coordinate: DeepSpeed's AutoTP groups are consecutive ranks (its (dp, tp) mesh),
        which read the same batches (its first forward checks that they do)."""
        t = self.options.autotp_size
        return self.env.rank // t, self.env.world_size // t

    def report(self) -> dict[str, Any]:
        """With --autotp-size, the mesh in result.json (DeepSpeed's (dp, tp) groups), as fsdp --tp reports its."""
        t = self.options.autotp_size
        return {"mesh": {"dp": self.env.world_size // t, "tp": t}} if t > 1 else {}

    def __init__(self, cfg, env, precision, options) -> None:
        super().__init__(cfg, env, precision, options)
        # DeepSpeed's fp16/bf16 blocks replace stratbench's casting and GradScaler.
        self.precision = _DeepSpeedPrecision(precision.name, env.device)
        self.engine = None
        self.applied_lr: list[float] = []
        self.ds_config: dict[str, Any] = {}

    # ---- set-up -------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """Join DeepSpeed's communication layer and write its config; the engine wraps in build_optimizer."""
        prepare_op_builds()  # the keyed op cache; a killed build's lock is taken over, a wait is bounded
        import deepspeed

        _avoid_shm_op_build()
        # The engine already created the process group (gloo on CPU, nccl on GPU); DeepSpeed adopts it.
        deepspeed.init_distributed(dist_backend=self.env.backend, verbose=False)
        self.ds_config = build_ds_config(self.cfg, self.options, self.env.world_size, self.total_steps)
        size_nvme_param_buffers(self.ds_config["zero_optimization"], model, self.env.world_size)
        if "tensor_parallel" in self.ds_config:
            self.ds_config["tensor_parallel"].setdefault("partition_config", autotp_partition_config(model))
        return model

    def run_files(self) -> dict[str, str]:
        return {"deepspeed_config.json": json.dumps(self.ds_config, indent=2) + "\n"}

    def build_optimizer(self, model: nn.Module, make_optimizer) -> torch.optim.Optimizer:
        """The client optimizer and the engine (every kernel build happens here); self.model becomes the engine."""
        import deepspeed

        if "optimizer" in self.ds_config:
            client = None  # built by DeepSpeed from the config's optimizer block
        elif self.options.ds_optimizer == "torch":
            client = make_optimizer(model.parameters())
        else:  # "cpu-adam"
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            client = DeepSpeedCPUAdam(
                model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, adamw_mode=True
            )
        zero = self.ds_config["zero_optimization"]
        if (zero.get("offload_optimizer") or {}).get("device") == "nvme":
            _align_swapped_gradients()
        param_nvme = (zero.get("offload_param") or {}).get("device") == "nvme"
        with _zero_init_keeps_dtype() if param_nvme else contextlib.nullcontext():
            engine, _, _, _ = deepspeed.initialize(
                model=model,
                optimizer=client,
                model_parameters=None if client is not None else model.parameters(),
                config=self.ds_config,
                mpu=self._autotp_groups(),
            )
        self.engine = engine
        self.model = engine
        # The torch optimizer DeepSpeed finally steps (its param_groups are the ones the ZeRO wrapper uses),
        # so stratbench's LR scheduler, where DeepSpeed has none, sets the learning rate DeepSpeed applies.
        return engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer

    def _autotp_groups(self):
        """Under --autotp-size, DeepSpeed's (dp, tp) process groups, passed as the ``mpu``: without one, deepspeed
        0.19's config reads the whole world as the data-parallel size and refuses the batch (train_batch_size !=
        micro-batch x accumulation x world), although the engine then splits the world into AutoTP groups itself."""
        if self.options.autotp_size == 1:
            return None
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=self.options.autotp_size)
        return groups

    def lr_scheduler(self, optimizer, lr_lambda):
        """DeepSpeed's scheduler when the config has a scheduler block (engine.step() steps it), else stratbench's."""
        if self.engine is not None and self.engine.lr_scheduler is not None:
            return _EngineLRSchedule(self)
        return super().lr_scheduler(optimizer, lr_lambda)

    def optimizer_report(self, optimizer) -> dict[str, Any]:
        report = super().optimizer_report(optimizer)
        assert self.engine is not None
        block = self.ds_config.get("optimizer")
        opt = report["optimizer"]
        if block is not None:
            opt["built_by"] = "deepspeed (config optimizer block)"
            opt["config"] = block
        opt["wrapper"] = (
            f"{type(self.engine.optimizer).__module__}.{type(self.engine.optimizer).__qualname__}"
        )
        sched = self.engine.lr_scheduler
        if sched is not None:
            report["lr_schedule"] = {
                "built_by": "deepspeed (config scheduler block)",
                "class": f"{type(sched).__module__}.{type(sched).__qualname__}",
                "config": self.ds_config["scheduler"],
            }
        return report

    # ---- one step -----------------------------------------------------------------------------
    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        """The loop calls step() once per accumulation group: tell DeepSpeed where the boundary is, so that
        gradients are reduced (and ZeRO-2/3 partitions finalised) on the last micro-step only."""
        assert self.engine is not None
        self.engine.set_gradient_accumulation_boundary(is_last_micro_step)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        assert self.engine is not None
        # The loop already divided the loss by grad_accum: DeepSpeed must not divide it again.
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, optimizer, clip) -> bool:
        """engine.step(): DeepSpeed unscales, clips (gradient_clipping from --clip-grad-norm), steps, zeroes."""
        assert self.engine is not None
        # engine.step() moves a config scheduler on to the next lr
        self.applied_lr = list(self.engine.get_lr())
        self.engine.step()
        self.precision.skipped_steps = int(self.engine.skipped_steps)
        return bool(self.engine.was_step_applied())

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError("DeepSpeed clips inside engine.step() (gradient_clipping in its config)")

    def _stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    # ---- measurement --------------------------------------------------------------------------
    def state_bytes(self, model: nn.Module, optimizer) -> dict[str, int]:
        """What this rank really holds: ZeRO-3 parameter partitions (``ds_tensor``), the partitioned gradient
        buffers, the optimizer's state tensors (over DeepSpeed's flat partitions) and fp32 master partitions."""
        assert self.engine is not None
        return _deepspeed_state_bytes(self.engine, self._stage())


def _apply_scheduler_lr(sched) -> None:
    """Set the optimizer's lr to what a DeepSpeed scheduler gives at its current iteration (its load_state_dict
    restores the counter only; the rate itself is set by its next step())."""
    from deepspeed.runtime.lr_schedules import update_lr

    if sched.last_batch_iteration >= 0:
        sched._last_lr = update_lr(sched.optimizer.param_groups, sched.get_lr())


class _EngineLRSchedule:
    """The loop's view of the LR scheduler DeepSpeed built from the config's scheduler block. DeepSpeed steps it
    inside engine.step() after each applied step, so ``step`` here does nothing and ``get_last_lr`` is the rate
    the step just taken used. Its state is DeepSpeed's (also saved in DeepSpeed's checkpoint), tagged with
    its class, so a checkpoint of another schedule is refused rather than misread."""

    def __init__(self, strategy: DeepSpeed) -> None:
        self.strategy = strategy
        self.scheduler = strategy.engine.lr_scheduler

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return list(self.strategy.applied_lr or self.strategy.engine.get_lr())

    def state_dict(self) -> dict[str, Any]:
        return {"deepspeed_scheduler": type(self.scheduler).__name__, **self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kind = type(self.scheduler).__name__
        if state.get("deepspeed_scheduler") != kind:
            raise CheckpointError(
                f"the checkpoint's LR schedule is {state.get('deepspeed_scheduler') or 'stratbench'}'s, this run's "
                f"is DeepSpeed's {kind}: resume with the same --deepspeed-config, or start with --init-from"
            )
        self.scheduler.load_state_dict({k: v for k, v in state.items() if k != "deepspeed_scheduler"})
        _apply_scheduler_lr(self.scheduler)


def deepspeed_memory(ctx, zero: dict[str, Any]):
    """DeepSpeed's per-rank model states for a ``zero_optimization`` block: weights in the compute dtype, a flat
    fp32 master partition the optimizer steps, partitioned gradients from stage 2, partitioned weights in
    stage 3, and the reduce/prefetch buckets sized by its defaults."""
    info, world, pd = ctx.info, ctx.world, ctx.param_bytes
    stage = int(zero.get("stage", 2))
    total = info.total
    bit = 2 if ctx.half else pd
    master_bytes = 4  # DeepSpeed's master partitions and optimizer state are fp32
    part = -(-total // world) if stage >= 1 else total
    m = RankMemory(params=(-(-total // world) if stage == 3 else total) * bit)
    # Stage 3 reuses the partition as the master when it already has the master's dtype on the device
    # (stage3.py, _create_fp32_partitions); stages 1-2 always clone it.
    offload_optimizer = "offload_optimizer" in zero
    same = stage == 3 and not ctx.half and not offload_optimizer
    m.master = part * master_bytes if ((stage >= 1 or ctx.half) and not same) else 0
    m.optim = ctx.opt_slots * part * master_bytes
    # After backward, stages 1-3 hold the reduced gradients of their own partition only; stage 0 all of them.
    m.grads = (total if stage == 0 else part) * bit
    m.step_scalars = 4 if ctx.adam else 0
    bucket = int(zero.get("reduce_bucket_size", DS_REDUCE_BUCKET))
    if stage >= 1 and zero.get("contiguous_gradients", True):
        # Stages 1-3 allocate their whole reduce bucket (torch.empty(reduce_bucket_size)), whatever the
        # model's size: 5e8 elements by default, 1.86 GiB in fp32 -- measured on CPU, 2.1 GiB allocated per
        # rank by a 2-rank ResNet-18 run whose model states are 0.1 GiB. Lower reduce_bucket_size for small models.
        m.buckets, m.bucket_note = bucket * bit, "DeepSpeed reduce bucket (allocated whole)"
    elif stage >= 2 and world > 1:
        m.buckets, m.bucket_note = min(bucket, total) * bit, "DeepSpeed reduce bucket"
    m.sharding_note = f"ZeRO-{stage}"
    # DeepSpeed casts the module to fp16/bf16 and feeds it 16-bit inputs, no autocast: traced as that 16-bit
    # model, not as autocast over fp32 weights, whose per-forward weight casts (2 bytes per parameter, saved
    # for backward) a DeepSpeed run never makes.
    m.trace_precision = DS_TRACE_PRECISION.get(ctx.cfg.precision)
    m.grads_whole_in_backward = stage <= 1  # every gradient waits for the reduction at the end of backward
    if stage == 3:
        persistent = sum(x for x in info.numels if x < DS_PARAM_PERSISTENCE)
        m.gathered = (persistent + min(DS_PREFETCH_BUCKET, 2 * info.largest_layer)) * bit
        m.gather_note = "small parameters kept whole (persistence threshold) + prefetch bucket"
    if "offload_param" in zero:
        m.offload_params_to_host()
    if offload_optimizer:
        m.offload_optimizer_to_host()
    # The step flattens the partition's gradients (a copy in their dtype) and converts the copy to the master
    # dtype: under fp16/bf16 both live at once (stage_1_and_2.py step, stage3.py _prepare_fp32_grad_for_sub_group;
    # measured on CPU: +1.2 MiB then +2.4 MiB for a 0.63M-element partition); in fp32 the conversion is the copy
    # itself. On the host (0 here) when the optimizer is offloaded.
    flat_copy = part * bit if ctx.half and m.master else 0
    m.step_scratch = m.master + flat_copy if stage >= 1 else (0 if offload_optimizer else None)
    return m


def deepspeed_overlap(zero: dict[str, Any]) -> float:
    """1 where DeepSpeed reduces on a side stream (``overlap_comm``; its default is on for stage 3 only)."""
    return 1.0 if zero.get("overlap_comm", int(zero.get("stage", 2)) == 3) else 0.0


def deepspeed_comm(ctx, zero: dict[str, Any]):
    """DeepSpeed's traffic per optimizer step (measured on deepspeed 0.19, docs/communication.md), in the
    compute dtype of its bit16 weights under fp16/bf16, else fp32:

    * stage 0: the gradients all-reduced (Φ);
    * stages 1 and 2: the gradients all-reduced too (Φ): DeepSpeed's "reduce-scatter" is an all-reduce of each
      bucket after which every rank keeps its partition (``use_multi_rank_bucket_allreduce``, the default);
      then a 4-byte fp32 all-reduce (the gradient-overflow/norm check), a 1-byte one more under fp16/bf16, and
      after the step the updated partitions all-gathered, the flat group padded to a multiple of 2 x world
      elements (``nccl_start_alignment_factor``);
    * stage 3: every parameter all-gathered once per step, padded to a multiple of the world (small models:
      the persistence threshold keeps them gathered, refreshed after each step; larger ones are gathered
      before use and, with the default reuse distance, kept for backward), the gradients reduce-scattered
      (Φ), and an 8-byte fp64 all-reduce (the overflow check).
    Not modelled: gradient accumulation with stages 2/3 (reduced every micro-step)."""
    n, info = ctx.world, ctx.info
    if n <= 1:
        return []
    stage = int(zero.get("stage", 2))
    bit = 2 if ctx.half else ctx.param_bytes
    phi = info.total * bit
    grads = Collective("all_reduce", phi, 1, "backward", n, "gradient buckets")
    if stage == 0:
        return [grads]
    if stage in (1, 2):
        rows = [grads, Collective("all_reduce", 4, 1, "optimizer", n, "overflow/norm check (fp32 scalar)")]
        if ctx.half:
            rows.append(Collective("all_reduce", 1, 1, "optimizer", n, "overflow flag (1 byte)"))
        gathered = ceil_to(info.total, 2 * n) * bit
        rows.append(Collective("all_gather", gathered, 1, "optimizer", n, "updated partitions"))
        return rows
    gathered = sum(ceil_to(x, n) for x in info.numels) * bit
    return [
        Collective("all_gather", gathered, len(info.numels), "forward", n, "each parameter once per step"),
        Collective("reduce_scatter", ceil_to(info.total, n) * bit, 1, "backward", n, "gradients"),
        Collective("all_reduce", 8, 1, "optimizer", n, "overflow check (fp64 scalar)"),
    ]


def save_engine_checkpoint(strategy: Strategy, engine, path: Path, ds_config: dict, extra: dict) -> Path:
    """engine.save_checkpoint into a temporary folder (every rank writes its partitions: a collective; across
    nodes the folder must be on a shared filesystem), rank 0 adds stratbench's header and swaps it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    if strategy.env.is_main and tmp.exists():
        shutil.rmtree(tmp)
    strategy.barrier()
    engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=True)
    t = autotp_size_of(ds_config)
    whole = strategy.checkpoint_io.model_state_dict(engine) if t > 1 else None  # a collective (all-gathers)
    if strategy.env.is_main:
        if whole is not None:
            extra = extra | {"autotp_size": t}
            checkpoint.atomic_save(whole, tmp / AUTOTP_WEIGHTS)
        header = {
            "format": checkpoint.FORMAT,
            "version": checkpoint.VERSION,
            "layout": "deepspeed",
            "deepspeed_tag": DS_TAG,
            "zero_stage": int(ds_config.get("zero_optimization", {}).get("stage", 0)),
            "deepspeed_config": ds_config,
        }
        checkpoint.atomic_save(header | extra, tmp / checkpoint.META_FILE)
        checkpoint.replace_path(tmp, path)
    strategy.barrier()
    return path


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _deepspeed_state_bytes(engine, stage: int) -> dict[str, int]:
    module = engine.module
    zero_opt = engine.optimizer
    basic = engine.basic_optimizer if engine.basic_optimizer is not None else zero_opt
    params = list(module.parameters())
    if stage == 3:
        param_bytes = sum(_nbytes(getattr(p, "ds_tensor", None)) for p in params)
    else:
        param_bytes = sum(_nbytes(p) for p in params)
    opt_params = {id(p): p for g in basic.param_groups for p in g["params"]}
    model_ids = {id(p) for p in params}
    opt_state = sum(
        _nbytes(v) for s in basic.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    # The tensors the torch optimizer steps: DeepSpeed's fp32 master partitions (when they are not the
    # model's own parameters, i.e. under ZeRO or a fp16/bf16 block).
    master = sum(_nbytes(p) for i, p in opt_params.items() if i not in model_ids)
    grads = 0
    seen: set[int] = set()
    for p in [*params, *opt_params.values()]:
        g = p.grad
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            grads += _nbytes(g)
    for name in ("averaged_gradients", "fp32_partitioned_groups_flat_grad", "grads_in_partition"):
        obj = getattr(zero_opt, name, None)
        tensors = []
        if isinstance(obj, dict):
            tensors = [t for v in obj.values() for t in (v if isinstance(v, list) else [v])]
        elif isinstance(obj, list):
            tensors = [t for v in obj for t in (v if isinstance(v, list) else [v])]
        elif isinstance(obj, torch.Tensor):
            tensors = [obj]
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                grads += _nbytes(t)
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grads,
        "optimizer_state_bytes": opt_state,
        "master_param_bytes": master,
    }


def _refuse_nvme_checkpoint(path: Path, tag: str) -> None:
    """A checkpoint of an --offload-optimizer nvme run keeps the fp32 weights and optimizer state in DeepSpeed's
    raw swap files (``offloaded_tensors/``): deepspeed 0.19's zero_to_fp32 does not read them (it fails), and its
    resume drops the swapped optimizer state (SGD's momentum: measured, the resumed curve left the uninterrupted
    one from the second step after the resume). Refused in one line rather than loaded wrong."""
    if (Path(path) / tag / "offloaded_tensors").is_dir():
        raise CheckpointError(
            f"{path} is a checkpoint of an --offload-optimizer nvme run: DeepSpeed keeps its fp32 weights and "
            "optimizer state in swap files that its zero_to_fp32 cannot read and its resume does not restore "
            "exactly, so stratbench can neither resume, consolidate nor --init-from it"
        )


def read_deepspeed_checkpoint(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Consolidate a DeepSpeed checkpoint folder into one fp32 model state with DeepSpeed's zero-to-fp32.

    The optimizer state is not consolidated (ZeRO's flat partitions have no portable per-parameter form
    short of DeepSpeed's universal checkpoint): the returned "optimizer" is empty, so another method
    resuming from it restores weights and progress and starts its optimizer state afresh.
    """
    tag = checkpoint.check_tag(path, meta.get("deepspeed_tag", DS_TAG))
    _refuse_nvme_checkpoint(path, tag)
    # zero_to_fp32 and DeepSpeed's stage-0 file are read with weights_only=False: check every file first
    # (load_any did too; this reader may be called on its own).
    checkpoint.check_folder(path)
    if not (Path(path) / tag).is_dir():
        raise CheckpointError(f"{path} has no DeepSpeed folder {tag!r} (incomplete checkpoint?)")
    if int(meta.get("autotp_size", 1)) > 1:
        # AutoTP: the mp_rank_XX files hold each rank's slices; the whole weights were gathered when it was saved.
        blob = checkpoint.safe_torch_load(Path(path) / AUTOTP_WEIGHTS)
        model = {k: v.float() if v.is_floating_point() else v for k, v in blob.items()}
    elif int(meta.get("zero_stage", 0)) == 0:
        # No ZeRO: the engine saved the full module (in the training dtype) in mp_rank_00_model_states.pt.
        files = sorted((Path(path) / tag).glob("mp_rank_*_model_states.pt"))
        if not files:
            raise CheckpointError(f"{path}/{tag} holds no mp_rank_*_model_states.pt")
        blob = checkpoint.safe_torch_load(files[0])
        model = {k: v.float() if v.is_floating_point() else v for k, v in blob["module"].items()}
    else:
        import contextlib
        import sys

        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(
            sys.stderr
        ):  # it prints progress; stdout may be JSON (evaluate --json)
            model = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
        model = {k: v.detach().cpu().clone() for k, v in model.items()}
    return {
        "model": model,
        "optimizer": {},
        "optimizer_note": "deepspeed optimizer state is not consolidated",
    }


def _register_layout() -> None:
    checkpoint.register_layout("deepspeed", read_deepspeed_checkpoint)


_register_layout()
