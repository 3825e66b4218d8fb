"""The DeepSpeed engine as a building block: what running it here needs (no shared-memory op build, the kernels
and the NVMe offload checked before any work, ``nvme_unavailable``), the fixes stratbench applies to DeepSpeed's
runtime (NVMe swap buffers and alignment, ZeRO-3's dtype), and its checkpoints: ``save_engine_checkpoint`` (the
engine's sharded folder plus stratbench's header), ``read_deepspeed_checkpoint`` (consolidated with zero_to_fp32)
and what a rank holds (``deepspeed_state_bytes``). Shared by the deepspeed and accelerate-deepspeed methods;
``deepspeed`` itself is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import checkpoint
from stratbench.core.errors import CheckpointError, ConfigError
from stratbench.strategies.base import Strategy

DS_TAG = "deepspeed"
"""Tag (sub-folder) DeepSpeed writes its files under inside a stratbench checkpoint folder."""


def avoid_shm_op_build() -> None:
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


def kernel_unavailable(op_name: str) -> str | None:
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


QUANTIZER_CPU = "This op had not been implemented on CPU backend"
"""DeepSpeed's own words when a ZeRO++ quantizer op (``QuantizerBuilder``, CUDA-only) is loaded on its CPU accelerator."""

QUANTIZED = (
    ("zero_quantized_weights", "--zero-quantized-weights"),
    ("zero_quantized_gradients", "--zero-quantized-gradients"),
)
"""ZeRO++'s quantised features: (DeepSpeed's key, stratbench's flag)."""


def zeropp_unavailable(zero: dict[str, Any], device: torch.device) -> str | None:
    """Why qwZ / qgZ cannot run here, or None: their int8 / int4 quantizer kernels are CUDA-only (DeepSpeed 0.19's CPU
    accelerator fails at start-up), and on a GPU the op must be buildable. hpZ needs no kernel."""
    asked = [flag for key, flag in QUANTIZED if zero.get(key)]
    if not asked:
        return None
    if device.type != "cuda":
        return (
            f"{' and '.join(asked)} {'needs' if len(asked) == 1 else 'need'} a GPU: DeepSpeed's ZeRO++ quantizer "
            "kernels are CUDA-only "
            f'(on CPU its start-up fails: "{QUANTIZER_CPU}")'
        )
    return kernel_unavailable("quantizer")


def nvme_unavailable(zero: dict[str, Any]) -> str | None:
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
    return kernel_unavailable("async_io")


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


def align_swapped_gradients() -> None:
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
def zero_init_keeps_dtype():
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


AUTOTP_WEIGHTS = "autotp_model_whole.pt"
"""File (in a checkpoint folder of an --autotp-size run) with the whole model: DeepSpeed saves each AutoTP rank's
slices (mp_rank_XX files), which its zero_to_fp32 does not merge."""

MOE_WEIGHTS = "moe_model_whole.pt"
"""File (in a checkpoint folder of a DeepSpeed-MoE run) with the whole model in the project's layout (the experts
gathered into the stacked tensors, ``parallel.deepspeed_moe.whole_moe_state``): DeepSpeed saves one file per expert
under its own module names, which zero_to_fp32 does not bring back to the model other methods build."""


def autotp_size_of(ds_config: dict[str, Any]) -> int:
    """The AutoTP degree a DeepSpeed config asks for (``tensor_parallel.autotp_size``; 1: off)."""
    return int((ds_config.get("tensor_parallel") or {}).get("autotp_size") or 1)


@contextlib.contextmanager
def autotp_whole(module: nn.Module):
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


def save_engine_checkpoint(strategy: Strategy, engine, path: Path, ds_config: dict, extra: dict) -> Path:
    """engine.save_checkpoint into a temporary folder (every rank writes its partitions: a collective; across
    nodes the folder must be on a shared filesystem), rank 0 adds stratbench's header and swaps it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    if strategy.env.is_main and tmp.exists():
        shutil.rmtree(tmp)
    strategy.barrier()
    engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=True)
    t, moe = autotp_size_of(ds_config), bool(getattr(engine, "has_moe_layers", False))
    # the whole model, a collective (AutoTP's all-gathers, the experts' over their ep groups)
    whole = strategy.checkpoint_io.model_state_dict(engine) if t > 1 or moe else None
    if strategy.env.is_main:
        if whole is not None:
            extra = extra | ({"whole_weights": MOE_WEIGHTS} if moe else {"autotp_size": t})
            checkpoint.atomic_save(whole, tmp / (MOE_WEIGHTS if moe else AUTOTP_WEIGHTS))
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


def deepspeed_state_bytes(engine, stage: int) -> dict[str, int]:
    module = engine.module
    zero_opt = engine.optimizer
    basic = engine.basic_optimizer if engine.basic_optimizer is not None else zero_opt
    params = list(module.parameters())
    if stage == 3:
        local = [_nbytes(getattr(p, "ds_tensor", None)) for p in params]
    else:
        local = [_nbytes(p) for p in params]
    param_bytes = sum(local)
    trainable = sum(n for n, p in zip(local, params, strict=True) if p.requires_grad)
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
        "trainable_param_bytes": trainable,
        "grad_bytes": grads,
        "optimizer_state_bytes": opt_state,
        "master_param_bytes": master,
    }


def refuse_nvme_checkpoint(path: Path, tag: str) -> None:
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
    refuse_nvme_checkpoint(path, tag)
    # zero_to_fp32 and DeepSpeed's stage-0 file are read with weights_only=False: check every file first
    # (load_any did too; this reader may be called on its own).
    checkpoint.check_folder(path)
    if not (Path(path) / tag).is_dir():
        raise CheckpointError(f"{path} has no DeepSpeed folder {tag!r} (incomplete checkpoint?)")
    whole = meta.get("whole_weights") or (AUTOTP_WEIGHTS if int(meta.get("autotp_size", 1)) > 1 else None)
    if whole:
        # AutoTP's slices and DeepSpeed-MoE's expert files: the whole weights were gathered when it was saved.
        blob = checkpoint.safe_torch_load(Path(path) / Path(whole).name)
        model = {k: v.float() if v.is_floating_point() else v for k, v in blob.items()}
    elif int(meta.get("zero_stage", 0)) == 0:
        # No ZeRO: the engine saved the full module (in the training dtype) in mp_rank_00_model_states.pt.
        files = sorted((Path(path) / tag).glob("mp_rank_*_model_states.pt"))
        if not files:
            raise CheckpointError(f"{path}/{tag} holds no mp_rank_*_model_states.pt")
        blob = checkpoint.safe_torch_load(files[0])
        model = {k: v.float() if v.is_floating_point() else v for k, v in blob["module"].items()}
    else:
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
