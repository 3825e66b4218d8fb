"""QLoRA's quantised base (``--quantize-base nf4``): the frozen weight of every Linear that LoRA adapts stored as
torchao's 4-bit NormalFloat ``NF4Tensor`` (Dettmers et al., QLoRA), the adapters on top in the weights' dtype.

Why torchao and not bitsandbytes: torchao's ``NF4Tensor`` is a tensor subclass that stays an ``nn.Linear``'s
``weight``, so PEFT's adapter layer wraps the Linear unchanged (its ``F.linear`` dispatches to torchao's
``LinearNF4``, which dequantises the weight for the product and saves only the 4-bit weight for backward), and
it implements FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` and ``split``, so ``fully_shard``
shards and all-gathers the 4-bit codes themselves (torchtune's QLoRA recipes rest on the same). bitsandbytes'
``Linear4bit`` replaces the module and keeps its quantisation state beside the packed ``Params4bit``, sharded by
FSDP1's flat parameters, not through FSDP2's per-parameter hooks (docs/finetuning.md, QLoRA).

Which layers: exactly the Linear layers LoRA adapts (``--lora-targets``; the default all-linear is every Linear
but the output head), the ``base_layer`` of each adapter; every other parameter stays in the weights' dtype,
frozen. The transform runs after the precision's cast (a cast of the model would dequantise an NF4 weight), so
the 4-bit weight dequantises to the dtype the run computes in.

Blocks: torchao's ``block_size`` 64 (one absmax scale per 64 weights) with the scales themselves quantised to
int8 in blocks of ``scaler_block_size`` (double quantisation). torchao's default 256 must divide the number of
blocks; here it is the largest divisor of the block count not above 256 that leaves a multiple of 8 scale
blocks (so FSDP2 can split them evenly over up to 8 ranks), else the largest divisor not above 256 (gpt-tiny's
192 x 192 attention weights have 576 blocks: 72). A weight whose size is not a multiple of 64 is refused.

Checkpoints store each quantised weight dequantised, under its usual key (``...base_layer.weight``: the values
the run computed with, readable by any loader and by a merge); loading one into a quantised model quantises
it again, whole (``_quantize_loaded``; under FSDP2 each rank then keeps its chunk), which may move a weight by
a small fraction of one 4-bit step (the double-quantised scales are re-derived), so a resumed QLoRA run is
close to, not bit-equal to, an unbroken one.

``--quantize-base int8`` (``int8_quantize``): each such Linear becomes bitsandbytes' ``Linear8bitLt``
(``has_fp16_weights=False``, ``threshold=0``: LLM.int8's row-wise absmax int8 weights without the outlier
columns, which only its inference matmul reads), one fp32 scale per output row (``SCB``) beside the int8 codes.
The swap replaces PEFT's ``base_layer`` after LoRA's injection and the precision's cast, in this transform's
place in ORDER: PEFT's plain adapter Linear calls its base layer whatever it is, the targets are matched on the
plain model as for nf4, and PEFT's own bnb adapter class (what injecting over a ``Linear8bitLt`` dispatches)
differs only in merging, which re-quantises the merged weight where an export wants it plain. On a CPU,
bitsandbytes trains through ``MatMul8bitFp``: the weight dequantised to the input's dtype for each product, in
forward and backward (``int8_dequant_bytes``). Checkpoints hold the weight dequantised (bitsandbytes' own
product of codes and scales) under the usual key, and a load quantises it again.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.core.optim import import_torchao
from stratbench.core.precision import Precision
from stratbench.models.transforms.base import Cost, Phase, Transform
from stratbench.models.transforms.lora import linear_layers, resolve_targets

BLOCK_SIZE = 64
"""torchao's NF4 ``block_size``: weights per absmax scale."""
SCALER_BLOCK_SIZE = 256
"""torchao's default ``scaler_block_size``: scales per int8 quantisation factor (the largest used here)."""
SCALE_SHARDS = 8
"""The scale blocks are kept a multiple of this where the block count allows (FSDP2 splits them by rank)."""
NF4_LEVELS = 16
"""torchao keeps the 16 NormalFloat levels as a lookup tensor in the weight's dtype beside each weight."""


def scaler_block_size(numel: int) -> int:
    """The double quantisation's block of scales for a weight of ``numel`` elements (module docstring)."""
    blocks = numel // BLOCK_SIZE
    divisors = [s for s in range(1, SCALER_BLOCK_SIZE + 1) if blocks % s == 0]
    even = [s for s in divisors if (blocks // s) % SCALE_SHARDS == 0]
    return max(even or divisors)


def nf4_bytes(numel: int, itemsize: int, shards: int = 1) -> int:
    """Bytes an NF4 weight of ``numel`` elements holds (torchao 0.18 ``NF4Tensor``), split over ``shards`` ranks
    by FSDP2: two 4-bit codes per uint8, one int8 scale per 64 weights, one quantisation factor per scale block
    (the weights' dtype), all three split; the scales' mean (one element) and the 16 levels kept whole."""
    factors = numel // BLOCK_SIZE // scaler_block_size(numel)
    split = numel // 2 + numel // BLOCK_SIZE + factors * itemsize
    return split // shards + (1 + NF4_LEVELS) * itemsize


def dequant_bytes(numel: int, itemsize: int) -> int:
    """The transient peak of dequantising one NF4 weight (``NF4Tensor.get_original_weight``, whose locals all
    live until it returns): both halves' codes as int64 indices (8 bytes per element in all), the looked-up
    and the scaled halves and the stacked result in the weights' dtype (3 x itemsize). An autocast copy in
    the compute dtype comes after these are freed and is smaller. Measured on this CPU (torch 2.13.0, torchao
    0.18.0, a 512 x 192 weight, glibc's bytes in use): 20.2 / 14.1 / 32.1 bytes per element for fp32 / bf16 /
    fp64 (20 / 14 / 32 here), 20.1 for fp32 dequantised to bf16."""
    return numel * (8 + 3 * itemsize)


def int8_bytes(numel: int, rows: int) -> int:
    """Bytes a bitsandbytes int8 weight of ``numel`` elements and ``rows`` output rows holds: one byte per
    element (``Int8Params``) and one fp32 absmax scale per row (``SCB``)."""
    return numel + 4 * rows


def int8_dequant_bytes(numel: int, itemsize: int) -> int:
    """The transient peak of bitsandbytes' CPU training matmul (``MatMul8bitFp``) over one int8 weight: its
    codes cast to the input's dtype and scaled in place, one weight-sized copy (the row scales' product is
    negligible), in forward and again in backward."""
    return numel * itemsize


def weight_bytes(kind: str, numel: int, rows: int, itemsize: int, shards: int = 1) -> int:
    """Bytes a weight quantised as ``kind`` (nf4 or int8) holds on one of ``shards`` ranks."""
    return int8_bytes(numel, rows) if kind == "int8" else nf4_bytes(numel, itemsize, shards)


def working_bytes(kind: str, numel: int, itemsize: int) -> int:
    """The transient bytes of computing with one weight of ``numel`` elements quantised as ``kind``."""
    return int8_dequant_bytes(numel, itemsize) if kind == "int8" else dequant_bytes(numel, itemsize)


def quantized_names(linear_names: tuple[str, ...] | list[str], cfg: TrainConfig) -> list[str]:
    """The Linear layers whose weight ``cfg`` quantises: LoRA's targets, or none without ``--quantize-base``."""
    if cfg.quantize_base == "none" or cfg.lora_rank <= 0:
        return []
    return resolve_targets(list(linear_names), cfg.lora_targets)


def _to_nf4() -> Any:
    """torchao's ``to_nf4`` (the qlora extra), imported on first use, its import's warnings kept quiet
    (``core.optim.import_torchao``)."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("--quantize-base nf4 needs torchao: pip install 'stratbench[qlora]'")
    return import_torchao("torchao.quantization").to_nf4


def _bnb() -> Any:
    """bitsandbytes (the qlora extra), imported on first use, its import's notes on absent GPU libraries kept
    quiet; its CPU inference matmul logs each call's cast of the input to fp16, which says nothing here."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--quantize-base int8 needs bitsandbytes: pip install 'stratbench[qlora]'")
    quiet = logging.getLogger("bitsandbytes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    finally:
        quiet.setLevel(level)
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    return bitsandbytes


@functools.cache
def _int8_linear_class() -> type[nn.Module]:
    """bitsandbytes' ``Linear8bitLt`` with one change: it computes in eval as in training. On a CPU its eval
    matmul also quantises each input row to int8 (LLM.int8's inference kernel), so a validation loss, ``predict``
    and ``export``'s parity check would see another model than the one trained (logits off by ~1e-2); its
    training matmul (``MatMul8bitFp`` on a CPU) computes with the dequantised weight, whatever the mode."""
    bnb = _bnb()

    class Int8Linear(bnb.nn.Linear8bitLt):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.state.is_training = True  # bitsandbytes' training matmul (its codes live in self.state already)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return bnb.matmul(x, self.weight, bias=bias, state=self.state)

    return Int8Linear


def _int8_linear(base: nn.Linear, device: torch.device) -> nn.Module:
    """bitsandbytes' ``Linear8bitLt`` (``_int8_linear_class``) holding ``base``'s weight quantised (on
    ``device``: bitsandbytes keeps its codes and scales beside the parameter, where a later move of the module
    would not follow them), frozen; ``base``'s bias shared. bitsandbytes' own ``init_8bit_state`` is done here, with the scales kept on the
    weight too, so that they count as the parameter's bytes (``strategies.base.local_bytes``)."""
    bnb = _bnb()
    q = _int8_linear_class()(base.in_features, base.out_features, bias=base.bias is not None,
                             has_fp16_weights=False, threshold=0.0, device="meta")  # fmt: skip
    w = bnb.nn.Int8Params(base.weight.detach(), requires_grad=False, has_fp16_weights=False)._quantize(device)
    q.weight = w
    q.state.CB, q.state.SCB, w.CB = w.data, w.SCB, None
    q.bias = base.bias
    q.weight_dtype = base.weight.dtype
    q.register_state_dict_post_hook(_int8_state)
    q.register_load_state_dict_pre_hook(_int8_loaded)
    return q.train(base.training)


def _int8_plain(layer: nn.Module) -> torch.Tensor:
    """An int8 layer's weight dequantised to the weights' dtype as bitsandbytes computes with it (codes x row
    scale / 127, ``MatMul8bitFp``)."""
    scale = layer.weight.SCB.unsqueeze(1).mul(1.0 / 127.0)
    return layer.weight.data.to(layer.weight_dtype, copy=True).mul_(scale)


def _int8_state(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    """State-dict post-hook of an int8 layer: its weight saved dequantised under the usual key, bitsandbytes'
    ``SCB`` and ``weight_format`` entries left out (the model's keys stay the plain model's)."""
    if prefix + "weight" in state:
        state[prefix + "weight"] = _int8_plain(module)
        state.pop(prefix + "SCB", None)
        state.pop(prefix + "weight_format", None)


def _int8_loaded(module: nn.Module, state: dict[str, Any], prefix: str, *_args: Any) -> None:
    """Load-state-dict pre-hook of an int8 layer: a plain weight quantised as the run quantised it (its codes
    copied into the parameter, its row scales into the layer's, in place)."""
    w = state.get(prefix + "weight")
    if w is None or w.dtype == torch.int8:
        return
    codes, scales, _ = _bnb().functional.int8_vectorwise_quant(w.to(module.weight.device, torch.float16))
    state[prefix + "weight"] = codes
    module.weight.SCB.copy_(scales)


def int8_quantize(model: nn.Module, names: list[str], device: torch.device | None = None) -> nn.Module:
    """``model`` with each named Linear (LoRA's ``base_layer`` where adapted) replaced by a frozen int8
    ``Linear8bitLt``, in place, quantised on ``device`` (default: where the weight is)."""
    for name in names:
        layer = model.get_submodule(name)
        if hasattr(layer, "base_layer"):
            holder, attr = layer, "base_layer"
        else:
            parent, _, attr = name.rpartition(".")
            holder = model.get_submodule(parent) if parent else model
        base = getattr(holder, attr)
        setattr(holder, attr, _int8_linear(base, device or base.weight.device))
    return model


def quantize_as(kind: str, model: nn.Module, names: list[str], device: torch.device | None = None) -> nn.Module:
    """``model`` with the named Linears' weights quantised as ``kind`` (nf4 or int8), in place."""
    return int8_quantize(model, names, device) if kind == "int8" else quantize(model, names)


def _dequantized_state(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    """State-dict post-hook of a quantised Linear: its weight saved dequantised, a plain tensor (a DTensor of
    plain shards under FSDP2), so that checkpoints and their readers never see torchao's subclass."""
    key = prefix + "weight"
    w = state.get(key)
    if w is None:
        return
    local = w.to_local() if hasattr(w, "to_local") else w
    if not hasattr(local, "get_original_weight"):
        return
    plain = local.get_original_weight()
    if local is not w:
        plain = type(w).from_local(plain, w.device_mesh, w.placements, shape=w.shape, stride=w.stride())
    state[key] = plain


def _quantize_loaded(
    module: nn.Module, state: dict[str, Any], prefix: str, *_args: Any
) -> None:
    """Load-state-dict pre-hook of a quantised Linear: the checkpoint's plain weight quantised whole, as the run
    quantised it, and (under FSDP2) this rank's dim-0 chunk of it taken (torchao's split), so that the copy into
    the NF4 parameter is of the same layout. Quantising a rank's shard alone would give it its own scales' mean,
    which the all-gather does not carry (and torchao's copy_ of a plain shard recurses: a shard keeps the whole
    weight's block count)."""
    key = prefix + "weight"
    w, param = state.get(key), module.weight
    if w is None or is_quantized(w) or not is_quantized(param):
        return
    full = w.full_tensor() if hasattr(w, "full_tensor") else w  # FSDP2: every rank loads the same layer together
    local = param.to_local() if hasattr(param, "to_local") else param
    q = _to_nf4()(full.to(local.dtype).contiguous(), BLOCK_SIZE, local.scaler_block_size)
    if local is param:
        state[key] = q
        return
    chunk = torch.split(q, local.shape[0])[param.device_mesh.get_local_rank()]
    state[key] = type(param).from_local(chunk, param.device_mesh, param.placements, shape=param.shape,
                                        stride=param.stride())  # fmt: skip


def quantize(model: nn.Module, names: list[str]) -> nn.Module:
    """``model`` with the weight of each named Linear (LoRA's ``base_layer`` where adapted) replaced by a frozen
    NF4 weight, in place; one line for a weight torchao cannot block."""
    to_nf4 = _to_nf4()
    modules = dict(model.named_modules())
    for name in names:
        layer = modules[name]
        layer = getattr(layer, "base_layer", layer)
        w = layer.weight
        if w.numel() % BLOCK_SIZE:
            raise ConfigError(
                f"--quantize-base nf4: {name}'s weight {tuple(w.shape)} has {w.numel()} elements, not a multiple "
                f"of torchao's NF4 block of {BLOCK_SIZE}; leave it out of --lora-targets"
            )
        q = to_nf4(w.detach().contiguous(), BLOCK_SIZE, scaler_block_size(w.numel()))
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.register_state_dict_post_hook(_dequantized_state)
        layer.register_load_state_dict_pre_hook(_quantize_loaded)
    return model


def apply_meta(model: nn.Module, meta: dict[str, Any] | None) -> nn.Module:
    """``model`` (adapters applied, on its device) with the base quantised as a checkpoint's ``lora_meta`` says
    (inference; the checkpoint's dequantised weights are quantised again as they load); unchanged without."""
    if not meta or meta.get("quantize_base", "none") == "none":
        return model
    names = resolve_targets(_unadapted(linear_layers(model)[0]), str(meta["targets"]))
    return quantize_as(str(meta["quantize_base"]), model, names)


def _unadapted(names: tuple[str, ...]) -> list[str]:
    """The Linear names of an adapted model as LoRA matched them: PEFT's adapter Linears (``lora_A``/``lora_B``)
    left out and each ``base_layer`` named by its adapter layer."""
    out = []
    for n in names:
        if ".lora_A." in n or ".lora_B." in n:
            continue
        out.append(n.removesuffix(".base_layer"))
    return out


@dataclass(frozen=True)
class QuantizeBase(Transform):
    """``--quantize-base nf4|int8``: the LoRA targets' frozen weights as torchao NF4 tensors or bitsandbytes
    int8 layers. Configured per run (``configured``: the targets); the instance in ``ORDER`` only answers
    ``applies_to``."""

    kind: str = "none"
    targets: str = ""

    name = "quantize_base"
    phase = Phase.BEFORE_WRAP
    cost = Cost(
        parameters="each quantised weight's bytes (weight_bytes) instead of itemsize per element: NF4's 0.5 per "
        "element + an int8 scale per 64 + the scale blocks' factors; int8's 1 per element + an fp32 scale per row",
        activations="+ one layer's dequantised working copy at a time (working_bytes, the largest quantised "
        "layer's), in forward and backward; nothing more saved (the quantised weight is what backward keeps)",
        note="the dequantisation's compute is left out of the projection",
    )

    def applies_to(self, cfg: TrainConfig) -> bool:
        return cfg.quantize_base != "none"

    def label(self, cfg: TrainConfig) -> str:
        return f"{self.name}:{cfg.quantize_base}"

    def configured(self, cfg: TrainConfig) -> QuantizeBase:
        return QuantizeBase(cfg.quantize_base, cfg.lora_targets)

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        if self.kind not in ("nf4", "int8"):
            raise ValueError("the quantize_base transform needs its kind: apply QuantizeBase().configured(cfg)")
        names = resolve_targets(_unadapted(linear_layers(model)[0]), self.targets)
        return quantize_as(self.kind, model, names, precision.device if precision else None)


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local shard) is a torchao NF4 weight or a bitsandbytes int8 one."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return type(local).__name__ in ("NF4Tensor", "Int8Params")


def dequantize(linear: nn.Module) -> nn.Module:
    """``linear`` with a plain (dequantised, frozen) weight in place of its quantised one: what a merge of
    LoRA's update into the weight needs (an NF4 tensor takes no in-place add; an int8 one would round it). An
    NF4 Linear is changed in place; an int8 ``Linear8bitLt`` gives a new ``nn.Linear``. Unchanged when plain."""
    w = getattr(linear, "weight", None)
    if w is None or not is_quantized(w):
        return linear
    if hasattr(w, "SCB"):
        plain = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        plain.weight = nn.Parameter(_int8_plain(linear), requires_grad=False)
        plain.bias = linear.bias
        return plain
    linear.weight = nn.Parameter(w.get_original_weight(), requires_grad=False)
    return linear
