"""The published formula for a transformer's activation memory, beside the trace as a stated cross-check.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198),
section 4: a GPT layer saves ``s*b*h*(34 + 5*a*s/h)`` bytes in 16 bit without recomputation (s sequence, b
micro-batch, h width, a heads), and ``2*s*b*h`` with full recomputation (only the layer's input). Their 34 is
for LayerNorm, a 4h GeLU MLP and dropout; adapted to ``models.transformer`` (RMSNorm, SwiGLU of width f, grouped
key/value heads repeated to every query head, no dropout, attention through ``scaled_dot_product_attention``),
counting in elements of e bytes (e = 2 in 16 bit) what each layer saves for backward:

* attention: the norm's input, the q/k/v projections' shared input, q, k and v as attention gets them (k and v
  repeated to all heads), the attention output (the output projection's input): ``6*s*b*h`` elements (their
  11 less the dropout mask and the separate LayerNorm count);
* the softmax: a flash/SDPA kernel keeps only its fp32 log-sum-exp, ``4*a*s*b`` bytes, instead of the paper's
  ``5*a*s^2*b`` (softmax output 2, dropout mask 1, dropout output 2); without dropout a math kernel would keep
  the softmax output, ``a*s^2*b`` elements (``math_attention_bytes``);
* the MLP: the norm's input, w1/w3's shared input, and w1's output, silu's output, w3's output and their
  product: ``2*s*b*h + 4*s*b*f`` elements (their 19 for a 4h GeLU MLP with dropout);

so ``e*s*b*h*(8 + 4*f/h) + 4*a*s*b`` bytes per layer, i.e. ``s*b*h*(16 + 8*f/h)`` in 16 bit against the paper's
34 (f = 8h/3: 37.3; Llama 3 8B's f = 3.5h: 44). With full recomputation a layer keeps its input, ``e*s*b*h``.
Outside the layers: the final norm's and the head's inputs (``2*e*s*b*h``), the loss's fp32 log-probabilities
``4*s*b*V`` (their ``4*s*b*v``) and the int64 targets ``8*s*b``. docs/memory.md compares it with the trace.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stratbench.core.precision import SPECS
from stratbench.models.transformer import TransformerConfig

SOURCE = "Korthikanti et al. 2022 (arXiv:2205.05198) section 4, adapted to RMSNorm/SwiGLU/GQA, no dropout"


@dataclass(frozen=True)
class FormulaActivations:
    """Bytes of activations saved for backward by the adapted formula (module docstring) for one micro-batch."""

    bytes: int
    """The whole model: layers, final norm, head and loss (what the trace's saved bytes count)."""
    per_layer_bytes: int
    element_bytes: int
    recompute: bool
    math_attention_bytes: int
    """The whole model with a math (non-flash) attention kernel: + the softmax output, a*s^2*b per layer."""
    formula: str
    source: str = SOURCE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def element_bytes(precision: str) -> int:
    """Bytes per saved activation element: the compute dtype's (autocast's for ``*-mixed``), as the paper's
    2 is its 16-bit mixed precision."""
    return SPECS[precision].compute_dtype.itemsize


def formula_activations(
    cfg: TransformerConfig, micro_batch: int, seq_len: int, precision: str, recompute: bool = False
) -> FormulaActivations:
    """The adapted Korthikanti et al. formula for ``cfg`` at ``micro_batch`` x ``seq_len`` tokens, attention
    through a flash/SDPA kernel; ``recompute``: full activation recomputation (activation checkpointing of
    every block)."""
    cfg.check()  # heads that do not divide the width: one line naming them
    s, b, h, f, a = seq_len, micro_batch, cfg.dim, cfg.ffn_hidden, cfg.n_heads
    e = element_bytes(precision)
    # the loss's fp32 (fp64) log-probabilities and the int64 targets
    loss_bytes = max(4, e) * s * b * cfg.vocab_size + 8 * s * b
    outside = 2 * e * s * b * h + loss_bytes
    if recompute:
        per_layer, text = e * s * b * h, f"{e}*s*b*h per layer (its input)"
        softmax = 0
    else:
        per_layer = e * s * b * (8 * h + 4 * f) + 4 * a * s * b
        text = f"s*b*h*({e // 2 * 16} + {e // 2 * 8}*f/h) + 4*a*s*b per layer (flash/SDPA attention)"
        softmax = e * a * s * s * b
    total = cfg.n_layers * per_layer + outside
    return FormulaActivations(
        bytes=total,
        per_layer_bytes=per_layer,
        element_bytes=e,
        recompute=recompute,
        math_attention_bytes=total + cfg.n_layers * softmax,
        formula=f"{text} + 2*{e}*s*b*h + 4*s*b*V (final norm, head input, fp32 loss)",
    )
