"""The strategy interface every training method implements, and the registry the CLI, the comparison matrix
and the parametrised tests all read.

A method is one module holding a ``Strategy`` subclass decorated with ``@register`` and, beside it, its two
companions (as Lightning Fabric splits its ``Strategy`` from its ``CheckpointIO``):

* the **runtime** (``Strategy``): its options (``Options``, a small dataclass whose fields become ``--flags``),
  what it needs (``check_supported``), set-up (``wrap``/``build_optimizer``), the step (``accumulate``/
  ``backward``/``optimizer_step``, or ``run_step`` to own the whole forward/backward schedule, as a pipeline
  does) and collectives. ``SingleDevice``-style no-op collectives mean the loop never asks "am I distributed?";
* its **checkpoint I/O** (``CheckpointIO`` subclass named by ``checkpoint_io_class``; ``strategy.checkpoint_io``
  is the one bound to the runtime): full state dicts, save and load in the method's layout;
* its **cost model** (``CostModel`` subclass named by ``cost``): memory per rank, the collectives of one step and
  the compute on the critical path, computed before any run from a ``MemoryContext`` (``strategies.costs``),
  read by ``stratbench.predicting`` (estimate, projection, advise) and the measured-vs-formula communication check.

Strategies outside the package register through the ``stratbench.strategies`` entry-point group (a module
that defines and ``@register``s a subclass); ``discover()`` loads them next to the built-in ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from stratbench.checkpoints import checkpoint
from stratbench.core.config import TrainConfig, from_dict
from stratbench.core.errors import ConfigError, did_you_mean
from stratbench.core.inputs import call_model, map_inputs
from stratbench.measuring.comm import Collective
from stratbench.measuring.model_trace import ModelSpec, model_info
from stratbench.models.hf import is_hf_moe
from stratbench.models.transforms import Phase, Pipeline
from stratbench.models.transforms.float8 import float8_unsupported
from stratbench.models.zoo import is_moe_model
from stratbench.strategies.costs import MemoryContext, RankMemory, loop_collectives

if TYPE_CHECKING:
    from stratbench.core.dist import DistEnv
    from stratbench.core.precision import Precision


class OptimizerFactory(Protocol):
    """Builds the optimizer on parameters; ``cls``/``kwargs`` let a strategy build it its own way (ZeRO)."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer: ...

    def prepare(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """What ``__call__`` does to the optimizer it builds, for one a strategy built its own way."""
        ...


Batch = tuple[torch.Tensor, torch.Tensor]
ENTRY_POINT_GROUP = "stratbench.strategies"


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    """This strategy has no options of its own."""


REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy available under ``cls.name``."""
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise RuntimeError(f"strategy name {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


class CheckpointIO:
    """How a method saves and loads checkpoints (Lightning Fabric's ``CheckpointIO``), bound to the runtime it
    serves (``strategy.checkpoint_io``): full state dicts keyed by parameter names, portable across methods, and
    the method's own layout on disk. The default gathers full state dicts (a collective for sharded methods)
    and writes one file from global rank 0; a method with its own layout (sharded folders, DeepSpeed's engine
    checkpoint) subclasses this in its own module."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unwrapped, fp32-or-native state dict on CPU. A collective for sharded methods."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Full optimizer state keyed by parameter names (portable across methods). A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def save_checkpoint(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> Path:
        """Write a full checkpoint: every rank takes part in gathering, global rank 0 writes atomically."""
        state = {
            "model": self.model_state_dict(model),
            "optimizer": self.optimizer_state_dict(model, optimizer),
        }
        if self.strategy.env.is_main:
            checkpoint.save_full(path, state | extra)
        self.strategy.barrier()
        return path

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Load any stratbench checkpoint (full file or sharded folder) into this method's model/optimizer."""
        state = checkpoint.load_any(path)
        self.load_model_state_dict(model, state["model"])
        if optimizer is not None and state.get("optimizer"):
            self.load_optimizer_state_dict(model, optimizer, state["optimizer"])
        return state


class CostModel:
    """What a method costs, computed before it runs from the shapes of the model (``MemoryContext``): the
    model states each rank holds, the collectives of one optimizer step and the compute on the critical path.
    Stateless (classmethods), so that ``stratbench.predicting`` asks the class (``strategy_cls.cost``) without
    building a runtime. The defaults say "no model" (None), which every reader reports as such, never as 0."""

    @classmethod
    def memory_model(cls, ctx: MemoryContext, rank: int) -> RankMemory | None:
        """Bytes of model states ``rank`` holds under this method (``stratbench.predicting.estimate`` adds the
        traced activations). None: no memory model, which ``estimate`` reports as such rather than as 0."""
        return None

    @classmethod
    def comm_model(cls, ctx: MemoryContext) -> list[Collective] | None:
        """The collectives one rank takes part in per optimizer step (``stratbench.measuring.comm``), from the
        same model shapes the memory model reads. None: no communication model (reported as such, never as 0);
        an empty list: the method does not communicate (one process)."""
        return None

    @classmethod
    def compute_scale(cls, ctx: MemoryContext) -> float:
        """The step's compute on the critical path, as a share of one data-parallel replica doing its whole
        batch's forward and backward on one device (``stratbench.predicting.projection``): 1 for every method
        that keeps the whole model on each device; a pipeline's busiest stage plus its bubble is less."""
        return 1.0

    @classmethod
    def comm_overlap(cls, ctx: MemoryContext) -> float:
        """The share of the overlappable communication this method can hide under compute (1: all of what the
        system allows; a method that reduces only after backward: 0)."""
        return 1.0

    @classmethod
    def mesh_dims(cls, ctx: MemoryContext) -> dict[str, int]:
        """The device mesh's named dimensions and sizes, outermost first, ranks laid out row-major (the last
        dimension's ranks are neighbours): what a ``Collective``'s ``dim`` names, so that the projection can
        place each group on nodes. Empty: one dimension, the whole world."""
        return {}

    @classmethod
    def predicted_comm(
        cls, cfg: TrainConfig, world_size: int, options: Any, device_type: str = "cpu"
    ) -> tuple[list[Collective] | None, str]:
        """The communication formula (``comm_model``) for one run of this method with its parsed ``options``,
        or None and why: what the run's measured collectives are checked against (``measuring.commvol``)."""
        try:
            info = model_info(ModelSpec.from_config(cfg))
        except Exception as exc:  # a user model the fake-tensor build cannot trace
            return None, f"the model's shapes could not be read ({type(exc).__name__}: {exc})"
        rows = cls.comm_model(MemoryContext(cfg, world_size, info, options, device_type))
        if rows is None:
            return None, f"strategy {cfg.strategy!r} has no communication model (Strategy.cost.comm_model)"
        return rows + loop_collectives(cfg, world_size), ""

    @classmethod
    def predicted_mesh(cls, cfg: TrainConfig, world_size: int, options: Any, device_type: str = "cpu") -> dict[str, int]:
        """The device mesh (``mesh_dims``) of one run of this method, on which the formula's groups are placed on
        the run's nodes (``measuring.comm.formula_links``); empty where the model's shapes cannot be read."""
        try:
            info = model_info(ModelSpec.from_config(cfg))
        except Exception:  # a user model the fake-tensor build cannot trace: predicted_comm says why
            return {}
        return cls.mesh_dims(MemoryContext(cfg, world_size, info, options, device_type))


class Strategy:
    """Base class. Subclasses override what differs; defaults implement one process on one device."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    needs_process_group: ClassVar[bool] = False
    """True for methods that run one process per device (torch.distributed)."""
    requirements: ClassVar[str] = "any device"
    """One line for `stratbench list`: what the method needs."""
    launcher: ClassVar[str] = "python"
    """How it is normally launched (python, torchrun, deepspeed, accelerate)."""
    baseline: ClassVar[bool] = False
    """The method every other one is compared with (speed-up 1.0x): one process on one device."""
    comm_reference: ClassVar[bool] = False
    """The method whose communication per step the report's "comm / step (vs ...)" column divides by."""
    spans_devices: ClassVar[bool] = True
    """False for a method that uses one device whatever the world size it is asked about."""
    calibration_refused: ClassVar[str] = ""
    """Why a run of this method on one device cannot calibrate the method's own overhead per step ("": it can;
    ``stratbench.predicting.projection.calibrate``, ``compare --calibrate``)."""
    check_settings: ClassVar[dict[str, Any]] = {}
    """The config settings `stratbench list --check` judges the method with where the default model is not one it
    applies to (tp: a built-in transformer on text), so that "here" says whether this machine runs it."""
    checkpoint_layout: ClassVar[str | None] = None
    """The checkpoint layout (``stratbench_meta.pt``'s "layout") whose pre-launch check this class owns
    (``check_checkpoint``); None: none."""
    takes_float8: ClassVar[bool] = False
    """Whether the method trains torchao's float8 Linears (``--float8``): the ones whose wrap leaves an
    ``nn.Linear`` subclass that computes its own product (single, ddp and ddp-zero, fsdp without tp) and whose tests prove it.
    Elsewhere ``float8_refusal`` says so in one line."""
    takes_moe: ClassVar[bool] = False
    """Whether the method trains a mixture of experts (``models.moe``): one whose every rank runs each MoE layer's
    whole forward and computes the loss beside it (single, ddp, fsdp), with tests that prove it. A method that cuts
    the model has no plan for the experts, and ``nn.DataParallel``'s replicas would keep the routing to themselves."""
    splits_model: ClassVar[bool] = False
    """The method cuts the model into pieces or shards its layers and feeds it one tensor (pipeline, tp,
    model-parallel): a user's data of several input tensors is refused in one line (``several_inputs_refusal``)."""
    channels_last_weights: ClassVar[bool] = True
    """--channels-last converts the weights too. False where the method needs contiguous parameters to flatten
    or shard them (FSDP2, DeepSpeed): there the inputs alone are channels-last, and convolutions still produce
    channels-last activations (their output follows the input's memory format)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        moved = sorted(set(vars(cls)) & _COMPANION_METHODS)
        if moved:
            raise TypeError(
                f"strategy {cls.__qualname__} defines {', '.join(moved)}: these belong to its companions, a "
                "CostModel subclass (memory/comm/compute) set as `cost` and a CheckpointIO subclass set as "
                "`checkpoint_io_class` (see stratbench.strategies.base)"
            )

    # ---- its companions, defined in the same module -------------------------------------------
    checkpoint_io_class: ClassVar[type[CheckpointIO]] = CheckpointIO
    """Its checkpoint I/O; ``self.checkpoint_io`` is one bound to this runtime."""
    cost: ClassVar[type[CostModel]] = CostModel
    """Its cost model (memory, communication, compute scale), asked by the class before any run."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, precision: Precision, options: Any) -> None:
        self.cfg = cfg
        self.env = env
        self.precision = precision
        self.options = options
        self.checkpoint_io: CheckpointIO = self.checkpoint_io_class(self)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.phase: Callable[[str], contextlib.AbstractContextManager] = _no_phase
        """``with self.phase("forward"): ...`` times a part of the step (RunMetrics sets it with --breakdown)."""
        self.total_steps: int | None = None
        """Optimizer steps the LR schedule spans (set by the loop before ``setup``)."""
        self.transforms = Pipeline(cfg)
        """The run's model transforms, applied by ``setup``; ``transforms.applied`` is what result.json lists."""

    # ---- what it needs ------------------------------------------------------------------------
    @classmethod
    def parse_options(cls, mapping: dict[str, Any]) -> Any:
        return from_dict(cls.Options, dict(mapping), where=f"strategy {cls.name!r} options")

    @classmethod
    def check_supported(cls, cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
        """None when the method can run here with this config, else one line naming the requirement."""
        return None

    @classmethod
    def refusal(cls, cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
        """Why the method cannot run ``cfg`` here, in one line, or None: what the model transforms need of the
        method and the device (``float8_refusal``), then the method's own ``check_supported``. What the engine,
        ``list``, ``advise`` and the estimate ask."""
        return cls.float8_refusal(cfg, device) or cls.moe_refusal(cfg) or cls.check_supported(cfg, device, world_size)

    @classmethod
    def moe_refusal(cls, cfg: TrainConfig) -> str | None:
        """Why this method cannot train a mixture of experts (``models.moe``), in one line; None where it can
        (``takes_moe``: its tests prove it) or the model is dense. A Hugging Face MoE (``models.hf_moe``) runs each
        layer whole on every rank: the options that split a layer or the sequence (``tp``, ``cp``, ``ep``) refuse it."""
        hf = is_hf_moe(cfg.model)
        if not (hf or is_moe_model(cfg.model)):
            return None
        if not cls.takes_moe:
            takers = ", ".join(sorted(n for n, c in all_strategies().items() if c.takes_moe))
            return f"model {cfg.model} is a mixture of experts, which {cls.name} does not train; train it under {takers}"
        try:
            opts = cls.parse_options(cfg.strategy_options)
        except ConfigError:  # check_supported names the bad option
            return None
        split = [f"--{k} {v}" for k in ("tp", "cp", "ep") if (v := getattr(opts, k, 1)) > 1]
        if hf and split:
            return (f"{cls.name} {' '.join(split)}: model {cfg.model} is a Hugging Face mixture of experts, which "
                    f"trains with every layer whole on each rank; drop {' '.join(split)}"
                    + (" (--ep takes the built-in MoE, e.g. gpt-moe-tiny)" if getattr(opts, "ep", 1) > 1 else ""))  # fmt: skip
        return None

    @classmethod
    def float8_refusal(cls, cfg: TrainConfig, device: torch.device) -> str | None:
        """Why this method cannot train float8 Linears (``--float8``) on ``device``, in one line; None where it
        can (``takes_float8``, and a device with float8 units or a CPU)."""
        if cfg.float8 == "none":
            return None
        if not cls.takes_float8:
            takers = ", ".join(sorted(name for name, c in all_strategies().items() if c.takes_float8))
            return (
                f"--float8 with {cls.name} is not supported (untested: torchao's Float8Linear under this method's "
                f"wrap); use one of: {takers}"
            )
        return float8_unsupported(device)

    @classmethod
    def lora_refusal(cls, cfg: TrainConfig) -> str | None:
        """Why this method cannot train LoRA adapters (``--lora-rank``) with ``cfg``'s options, in one line; None
        where it can. Its ``check_supported`` returns it, and the estimate's row of the method says it."""
        return None

    @classmethod
    def quantize_refusal(cls, cfg: TrainConfig) -> str | None:
        """Why this method cannot train LoRA over a quantised base (``--quantize-base``), in one line; None where
        it can (single, fsdp). The methods that take LoRA return it from ``check_supported``; the others refuse
        the adapters first (``lora_refusal``)."""
        if cfg.quantize_base == "none":
            return None
        if cfg.quantize_base == "int8":
            return (
                f"--quantize-base int8 with {cls.name} is not supported (bitsandbytes' int8 layers keep their "
                "codes and row scales beside the parameter, which this method does not broadcast or shard); "
                "use single"
            )
        return (
            f"--quantize-base with {cls.name} is not supported (untested: torchao's NF4 weights are sharded "
            "through FSDP2's all-gather hooks; this method broadcasts, flattens or casts the parameters itself); "
            "use single or fsdp"
        )

    @classmethod
    def check_checkpoint(cls, path: Path, meta: dict[str, Any]) -> None:
        """Refuse (CheckpointError), before any process starts, a checkpoint in ``checkpoint_layout`` that no run
        can resume or start from; ``meta`` is its header. Nothing by default."""

    @classmethod
    def options_for_world(cls, cfg: TrainConfig, world_size: int) -> dict[str, Any]:
        """The options a comparison row of this method runs with on ``world_size`` devices: the user's own,
        completed where the method's defaults would not fit that world (a pipeline's layout)."""
        return dict(cfg.strategy_options)

    @classmethod
    def devices_for_world(cls, world_size: int) -> int:
        """How many devices a row of this method uses when a comparison offers it ``world_size``."""
        return world_size if cls.spans_devices else 1

    @classmethod
    def data_parallel_size(cls, cfg: TrainConfig, world_size: int) -> int:
        """How many ways the global batch is split across processes (DataParallel splits inside one)."""
        return world_size

    def data_shard(self) -> tuple[int, int]:
        """(which shard of the data this process reads, how many shards): every process its own by default;
        processes that work on the same samples (the stages of one pipeline) share a shard."""
        return self.env.rank, self.env.world_size

    def sequence_shards(self) -> int:
        """How many processes split one sample's positions between them (context parallelism: C), each
        averaging its gradients with the others; 1 by default."""
        return 1

    def step_chunks(self) -> int:
        """How many micro-batches this process computes one step's samples in: the loop's ``grad_accum``
        micro-steps by default (a pipeline: its schedule's micro-batches). The data is ordered so that they are
        the shares that many data-parallel ranks would take (``data.virtual_rank_order``)."""
        return self.cfg.grad_accum

    # ---- set-up -------------------------------------------------------------------------------
    def setup(
        self, model: nn.Module, make_optimizer: OptimizerFactory
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The one set-up order: the model transforms before the wrap (``models.transforms``: activation
        checkpointing, the precision's cast), move, channels-last, wrap, build the optimizer on the wrapped
        parameters, then the transforms after the wrap (compile) on the model the loop runs (``self.model``
        stays the wrap's). Strategies override the steps (``move``, ``wrap``, ``build_optimizer``), not this."""
        model = self.transforms.apply(model, Phase.BEFORE_WRAP, self.precision)
        model = self.move(model)
        if self.cfg.channels_last and self.channels_last_weights:
            model = model.to(memory_format=torch.channels_last)
        self.model = self.wrap(model)
        # build_optimizer may wrap self.model again where a library wraps model and optimizer together
        # (deepspeed.initialize, Accelerator.prepare).
        self.optimizer = self.build_optimizer(self.model, make_optimizer)
        return self.transforms.apply(self.model, Phase.AFTER_WRAP, self.precision), self.optimizer

    def move(self, model: nn.Module) -> nn.Module:
        return model.to(self.env.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def build_optimizer(self, model: nn.Module, make_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        return make_optimizer(model.parameters())

    def lr_scheduler(self, optimizer: torch.optim.Optimizer, lr_lambda: Callable[[int], float]) -> Any:
        """The LR schedule the loop steps once per optimizer step: stratbench's own over ``optimizer``. A
        strategy whose library builds and steps its own schedule (a DeepSpeed JSON's scheduler block) returns
        a view of that one instead (``step``, ``get_last_lr``, ``state_dict``, ``load_state_dict``)."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    def optimizer_report(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What result.json records as the optimizer and LR schedule that actually ran."""
        cfg = self.cfg
        return {
            "optimizer": {"class": _qualname(optimizer), "built_by": "stratbench (--optimizer)"},
            "lr_schedule": {
                "built_by": "stratbench (--lr-schedule)",
                "schedule": cfg.lr_schedule,
                "peak_lr": cfg.lr,
                "warmup_steps": cfg.lr_warmup_steps,
                "total_steps": self.total_steps,
            },
        }

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module under any wrapper (DDP's ``.module``, DataParallel's, compile's ``_orig_mod``)."""
        while True:
            inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
            if not isinstance(inner, nn.Module):
                return model
            model = inner

    # ---- one step -----------------------------------------------------------------------------
    def forward_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward pass and loss under the precision's autocast; returns (loss, logits). ``x`` may be several
        tensors (``core.inputs``: ``model(*x)`` or ``model(**x)``)."""
        x = map_inputs(self.precision.convert_input, x)
        with self.precision.autocast():
            logits = call_model(model, x)
            loss = loss_fn(self.precision.loss_input(logits), y)
        return loss, logits

    @classmethod
    def several_inputs_refusal(cls) -> str | None:
        """Why the method cannot feed a model several input tensors (``splits_model``), or None."""
        if not cls.splits_model:
            return None
        takers = ", ".join(sorted(name for name, c in all_strategies().items() if not c.splits_model))
        return (f"{cls.name} cuts the model and feeds it one tensor; a model of several inputs runs under "
                f"{takers}")

    def run_step(self, model: nn.Module, batches: list[Batch], loss_fn: Callable) -> torch.Tensor:
        """Forward and backward of one optimizer step's micro-batches; returns their mean loss (fp64, detached).

        The default runs them one after the other, each under ``accumulate`` with the loss divided by their
        count; a strategy with its own schedule (a pipeline runs all micro-batches through its stages
        together) overrides this one method."""
        with self.phase("other"):
            total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for k, (x, y) in enumerate(batches):
            with self.accumulate(is_last_micro_step=k == len(batches) - 1):
                with self.phase("forward"):
                    loss, _ = self.forward_loss(model, x, y, loss_fn)
                with self.phase("backward"):
                    self.backward(loss / len(batches))
            with self.phase("other"):  # the loss bookkeeping
                total += loss.detach()
        return total / len(batches)

    def eval_per_sample(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, per_sample_eval: Callable
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation: each sample's cross-entropy and share of correct predictions of one batch
        (``per_sample_eval(logits, targets)``: the loop's). A method that splits a sample over processes combines
        its parts itself."""
        return per_sample_eval(self.eval_logits(model, x), y)

    def eval_logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's output on an evaluation batch under the precision's autocast, as the loss takes it."""
        x = map_inputs(self.precision.convert_input, x)
        with self.precision.autocast():
            logits = call_model(model, x)
        return self.precision.loss_input(logits)

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step; methods that all-reduce gradients skip it on all but the last."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        assert self.model is not None
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, clip: float | None) -> bool:
        """Unscale, clip, step and zero the gradients; returns False when the step was skipped."""
        self.precision.unscale(optimizer)
        if clip:
            self.clip_grad_norm(clip)
        stepped = self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return stepped

    # ---- collectives (no-ops with one process) ------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and self.env.world_size > 1:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op])
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if dist.is_available() and dist.is_initialized() and self.env.world_size > 1:
            out: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(out, obj)
            return out
        return [obj]

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()

    def synchronize(self) -> None:
        """Wait for queued device work, so that a clock read after it is honest."""
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    # ---- measurement --------------------------------------------------------------------------
    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of parameters (of them the trainable ones: the rest is a frozen base), gradients and optimizer
        state that this rank actually holds."""
        return {
            "param_bytes": sum(local_bytes(p) for p in model.parameters()),
            "trainable_param_bytes": sum(local_bytes(p) for p in model.parameters() if p.requires_grad),
            "grad_bytes": sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optimizer_state_bytes": sum(
                local_bytes(v)
                for s in optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            ),
        }

    def report(self) -> dict[str, Any]:
        """Method-specific facts for result.json (a collective where ranks differ); none by default."""
        return {}

    def run_files(self) -> dict[str, str]:
        """Files of the method's own the main rank writes into the output folder once set-up has succeeded on
        every rank (name -> text: a generated DeepSpeed config); set-up itself writes nothing there."""
        return {}

    def memory_devices(self) -> list[torch.device]:
        """Devices whose memory this process should report (DataParallel reports every GPU)."""
        return [self.env.device]


_COMPANION_METHODS = frozenset(
    [n for n in vars(CostModel) if not n.startswith("_")]
    + [n for n in vars(CheckpointIO) if not n.startswith("_")]
)
"""What a Strategy no longer defines itself: a plug-in written against the old interface fails loudly."""


def _no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def local_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds on this rank: a DTensor's local shard only, a wrapper subclass's inner tensors (torchao's
    quantised optimizer states: uint8 codes, fp32 scales and lookup table, under a full-size fp32 face), a
    bitsandbytes int8 weight's row scales (its ``SCB``) with its codes."""
    if is_traceable_wrapper_subclass(t):  # DTensor (FSDP2) holds _local_tensor; torchao's states codes/scale/qmap
        inner = (getattr(t, n) for n in t.__tensor_flatten__()[0])  # DTensor also names its device_mesh
        return sum(local_bytes(x) for x in inner if isinstance(x, torch.Tensor))
    scales = getattr(t, "SCB", None)
    extra = local_bytes(scales) if isinstance(scales, torch.Tensor) else 0
    return t.numel() * t.element_size() + extra


def get_strategy(name: str) -> type[Strategy]:
    discover()
    if name not in REGISTRY:
        raise ConfigError(
            f"unknown strategy {name!r}{did_you_mean(name, REGISTRY)}; choose one of: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[name]


def baseline_name() -> str:
    """The name of the baseline method (``Strategy.baseline``)."""
    discover()
    return next(name for name, cls in REGISTRY.items() if cls.baseline)


def comm_reference_name() -> str:
    """The name of the method communication is compared with (``Strategy.comm_reference``)."""
    discover()
    return next(name for name, cls in REGISTRY.items() if cls.comm_reference)


def strategy_for_layout(layout: str | None) -> type[Strategy] | None:
    """The method that owns checkpoint layout ``layout`` (``Strategy.checkpoint_layout``); None: no method does."""
    discover()
    return next(
        (cls for cls in REGISTRY.values() if layout is not None and cls.checkpoint_layout == layout), None
    )


def all_strategies() -> dict[str, type[Strategy]]:
    discover()
    return dict(REGISTRY)


def iter_option_fields() -> Iterator[tuple[type[Strategy], dataclasses.Field]]:
    for cls in all_strategies().values():
        for f in dataclasses.fields(cls.Options):
            yield cls, f


_DISCOVERED = False


def discover() -> None:
    """Import every module in ``stratbench.strategies`` so that each registers itself (a subpackage, such as
    ``parallel``'s building blocks, holds no method: the methods that use it import it)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name != "base" and not info.ispkg:
            importlib.import_module(f"{__package__}.{info.name}")

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()  # the module registers its strategy with @register
        except Exception as exc:
            raise ConfigError(
                f"strategy plug-in {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}"
            ) from exc
    _DISCOVERED = True


checkpoint.add_layout_source(discover)  # a sharded folder's reader is in its method's file
