"""A decoder-only transformer family (GPT-2-small-class to Llama 3 8B), pure torch with random weights.

The architecture is Llama's: pre-norm RMSNorm blocks, rotary positions, grouped-query causal attention through
``scaled_dot_product_attention``, a SwiGLU MLP, no biases. The blocks live in ``Transformer.layers`` and map a
hidden state to a hidden state, so FSDP wraps, activation checkpointing recomputes and a pipeline cuts per
block. The model holds parameters only (no buffers: rotary angles are computed in ``forward``), so that it can
be built on the meta device and materialised later (``to_empty`` then ``init_weights``, and ``tie_weights``
when the head is tied, since ``to_empty`` gives the two modules separate tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

from stratbench.core.errors import ConfigError
from stratbench.models.moe import MoEFeedForward

INITS = ("gpt2", "llama")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (transformers' ``rope_type: llama3``; Meta's ``apply_scaling``): the
    low frequencies divided by ``factor``, the high ones kept, the ones between blended, so that a model
    trained at ``original_max_seq_len`` positions reads longer contexts. Llama 3.2 1B's config.json sets it."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __str__(self) -> str:
        return (
            f"llama3 (factor {self.factor:g}, low_freq_factor {self.low_freq_factor:g}, high_freq_factor "
            f"{self.high_freq_factor:g}, original_max_position_embeddings {self.original_max_seq_len})"
        )

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (transformers' ``_compute_llama3_parameters``, same arithmetic)."""
        low_wavelen = self.original_max_seq_len / self.low_freq_factor
        high_wavelen = self.original_max_seq_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_seq_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)


@dataclass(frozen=True)
class TransformerConfig:
    """The shape and initialisation of one transformer (frozen: ``SIZES`` cannot be changed by a caller);
    ``check`` says what is wrong in one line."""

    vocab_size: int = 256
    """Token ids run from 0 to vocab_size - 1 (the data decides: byte-level text has 256)."""
    dim: int = 192
    """Width of the residual stream (the embedding size)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; each has dim / n_heads channels."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention shares each among n_heads / n_kv_heads query heads);
    None means n_heads (plain multi-head attention)."""
    ffn_hidden: int = 512
    """Hidden width of the SwiGLU MLP (three dim x ffn_hidden matrices)."""
    max_seq_len: int = 256
    """The longest sequence the model accepts (a longer one is refused, not silently extrapolated)."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Llama 3: 500000, for long contexts)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's frequency scaling of the rotary positions (Llama 3.2 1B's); None: plain rotary positions."""
    tie_embeddings: bool = True
    """Whether the output head is the token embedding matrix (GPT-2, Llama 3.2 1B) or its own (Llama 3 8B)."""
    init: str = "gpt2"
    """Weight initialisation: ``gpt2`` (normal 0.02, residual projections scaled by the depth) or ``llama``
    (torchtitan's: truncated normal, per-layer depth scaling, unit-variance embedding)."""
    head_dim_override: int | None = None
    """Channels per head where they are not dim / n_heads (Qwen3's 128 at dim 2048 and 32 heads); None: dim / n_heads."""
    # mixture of experts (models.moe): n_experts 0 is a dense model, and the fields below must then stay unset
    n_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model (every block's MLP is ``ffn_hidden`` wide)."""
    moe_top_k: int | None = None
    """Experts each token is routed to (1 <= k <= n_experts)."""
    moe_hidden: int | None = None
    """Hidden width of each routed expert's SwiGLU MLP (HF ``moe_intermediate_size``; Mixtral: ``intermediate_size``)."""
    n_shared_experts: int = 0
    """Experts every token passes through (DeepSeek's shared experts: one dense MLP n_shared x moe_hidden wide)."""
    moe_first_dense: int = 0
    """The first blocks keep a dense MLP of ``ffn_hidden`` (DeepSeek-V3's ``first_k_dense_replace``)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Mixtral, Qwen3-MoE ``norm_topk_prob``, DeepSeek-V3)."""
    capacity_factor: float | None = None
    """None: dropless (every token reaches its k experts); c > 0: an expert keeps at most ceil(c tokens k / E)."""
    aux_loss_coef: float | None = None
    """Weight of the load-balancing loss (the layers' mean) in the training loss (HF ``router_aux_loss_coef``)."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)  # frozen: set once, here

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id``'s MLP is routed experts."""
        return self.is_moe and layer_id >= self.moe_first_dense

    def check(self) -> TransformerConfig:
        """Raise a one-line ConfigError naming the first bad value and what is allowed; return self."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"transformer {name} must be a positive integer, not {value!r}")
        if self.head_dim_override is not None and (
            isinstance(self.head_dim_override, bool) or not isinstance(self.head_dim_override, int)
            or self.head_dim_override <= 0
        ):  # fmt: skip
            raise ConfigError(f"transformer head_dim_override must be a positive integer or None, not "
                              f"{self.head_dim_override!r}")  # fmt: skip
        for name in ("norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"transformer {name} must be positive, not {getattr(self, name)!r}")
        scaling = self.rope_scaling
        if scaling is not None and not (
            scaling.factor > 0 and 0 < scaling.low_freq_factor < scaling.high_freq_factor
            and scaling.original_max_seq_len > 0
        ):  # fmt: skip
            raise ConfigError(
                f"transformer rope_scaling {scaling} needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                "a positive original context"
            )
        if self.init not in INITS:
            raise ConfigError(f"unknown transformer init {self.init!r}; choose one of: {', '.join(INITS)}")
        self._check_heads()
        self._check_moe()
        return self

    def _check_moe(self) -> None:
        """The MoE fields: unset on a dense model; on an MoE model a top-k within the experts, a positive expert
        width and capacity factor, a non-negative loss weight, dense blocks fewer than the blocks."""
        moe_fields = {"moe_top_k": self.moe_top_k, "moe_hidden": self.moe_hidden, "capacity_factor": self.capacity_factor,
                      "aux_loss_coef": self.aux_loss_coef, "n_shared_experts": self.n_shared_experts or None,
                      "moe_first_dense": self.moe_first_dense or None}  # fmt: skip
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ConfigError(f"transformer n_experts must be 0 (dense) or a positive integer, not {self.n_experts!r}")
        if not self.is_moe:
            given = [f"{k} {v!r}" for k, v in moe_fields.items() if v is not None]
            if given:
                raise ConfigError(f"transformer {given[0]} applies to a mixture of experts; this model is dense "
                                  "(n_experts 0): set n_experts, or leave the MoE fields unset")  # fmt: skip
            return
        k = self.moe_top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n_experts:
            raise ConfigError(f"transformer moe_top_k {k!r} must be an integer from 1 to n_experts {self.n_experts}")
        if isinstance(self.moe_hidden, bool) or not isinstance(self.moe_hidden, int) or self.moe_hidden <= 0:
            raise ConfigError(f"transformer moe_hidden must be a positive integer, not {self.moe_hidden!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"transformer capacity_factor {self.capacity_factor!r} must be > 0, or None (dropless)")
        if self.aux_loss_coef is None or not self.aux_loss_coef >= 0:
            raise ConfigError(f"transformer aux_loss_coef {self.aux_loss_coef!r} must be a number >= 0")
        if not 0 <= self.moe_first_dense < self.n_layers or self.n_shared_experts < 0:
            raise ConfigError(f"transformer moe_first_dense {self.moe_first_dense} must be from 0 to n_layers - 1 "
                              f"({self.n_layers - 1}) and n_shared_experts {self.n_shared_experts} >= 0")  # fmt: skip

    def _check_heads(self) -> None:
        """Heads must split dim evenly into an even head size (rotary rotates channel pairs), and the query
        heads must split evenly among the key/value heads."""
        fitting = [h for h in range(1, self.dim + 1) if self.dim % h == 0 and (self.dim // h) % 2 == 0]
        allowed = ", ".join(map(str, fitting)) or "none (dim is odd)"
        if self.dim % self.n_heads and self.head_dim_override is None:
            raise ConfigError(
                f"transformer n_heads {self.n_heads} does not divide dim {self.dim}; choose one of: {allowed}"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"transformer head dim {self.head_dim} (dim {self.dim} / n_heads {self.n_heads}) is odd, and "
                f"rotary positions rotate channel pairs; choose n_heads among: {allowed}"
            )
        if self.n_heads % self.n_kv_heads:
            kv = ", ".join(str(h) for h in range(1, self.n_heads + 1) if self.n_heads % h == 0)
            raise ConfigError(
                f"transformer n_kv_heads {self.n_kv_heads} does not divide n_heads {self.n_heads}; "
                f"choose one of: {kv}"
            )


SIZES: dict[str, TransformerConfig] = {
    # ~1.9M parameters at vocab 256: a few steps a second on two CPU cores. Untied, so that a pipeline can put
    # the embedding and the head on different stages (a tied pair would need its gradients summed across them).
    "gpt-tiny": TransformerConfig(
        vocab_size=256, dim=192, n_layers=4, n_heads=4, ffn_hidden=512, max_seq_len=256, tie_embeddings=False,
        init="gpt2",
    ),
    # gpt-tiny's widths (the same 1.87M parameters) with a 4096-token context, for long-sequence runs on a CPU
    # (the compare preset llm-long: activation checkpointing and context parallelism at 1k-4k tokens); rotary
    # positions hold no table, so only the limit changes.
    "gpt-tiny-long": TransformerConfig(
        vocab_size=256, dim=192, n_layers=4, n_heads=4, ffn_hidden=512, max_seq_len=4096, tie_embeddings=False,
        init="gpt2",
    ),
    # GPT-2 small's width and depth (Radford et al. 2019); SwiGLU 3 x 768 x 2048 = GPT-2's 2 x 768 x 3072, and
    # vocab 50304 = 50257 padded to a multiple of 64 (nanoGPT). Rotary instead of learned positions and no
    # biases: 123.6M parameters against GPT-2's 124.4M.
    "gpt2-small": TransformerConfig(
        vocab_size=50304, dim=768, n_layers=12, n_heads=12, ffn_hidden=2048, max_seq_len=1024, init="gpt2"
    ),
    # Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json): 1,235,814,400 parameters, its rotary positions scaled
    # as Llama 3.1's (rope_scaling llama3), so that its checkpoint gives transformers' logits; max_seq_len is the
    # 8192 it was pre-trained at.
    "llama-1b": TransformerConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
        max_seq_len=8192, rope_theta=500000.0, rope_scaling=RopeScaling(), tie_embeddings=True, init="llama",
    ),
    # Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json): 8,030,261,248 parameters.
    "llama-8b": TransformerConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
        max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False, init="llama",
    ),
    # Llama 3.1 8B's shape (meta-llama/Llama-3.1-8B config.json: Llama 3 8B's, rope_scaling llama3 factor 8) with
    # a context of 262,144 tokens, twice its published 131,072: the longest torchtitan trains its 8B model at,
    # with context parallelism (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 2; its
    # train.py sets the model's max_seq_len to the training seq_len). For long-context runs, estimates and
    # projections (fsdp --cp); parameters and FLOPs per token at a sequence length are llama-8b's.
    "llama-8b-long": TransformerConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
        max_seq_len=262144, rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0), tie_embeddings=False,
        init="llama",
    ),
    # A mixture of experts at gpt-tiny's widths, for CPU tests: every block's MLP is 4 SwiGLU experts of 256, each
    # token routed to 2 (active MLP width 512, gpt-tiny's), dropless; Switch's load-balancing weight 0.01
    # (Fedus et al. 2022, section 2.2: alpha = 10^-2).
    "gpt-moe-tiny": TransformerConfig(
        vocab_size=256, dim=192, n_layers=4, n_heads=4, ffn_hidden=512, max_seq_len=256, tie_embeddings=False,
        init="gpt2", n_experts=4, moe_top_k=2, moe_hidden=256, aux_loss_coef=0.01,
    ),
    # The shapes below are for estimates on the meta device; the routing is this module's softmax top-k.
    # Mixtral-8x7B (mistralai/Mixtral-8x7B-Instruct-v0.1 config.json, revision eba92302: hidden_size 4096,
    # intermediate_size 14336, 32 layers, 32 heads, 8 kv heads, num_local_experts 8, num_experts_per_tok 2,
    # vocab 32000, rope_theta 1e6, max_position_embeddings 32768, router_aux_loss_coef 0.02, untied).
    "mixtral-8x7b": TransformerConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=32768,
        rope_theta=1e6, tie_embeddings=False, init="llama", n_experts=8, moe_top_k=2, moe_hidden=14336,
        aux_loss_coef=0.02,
    ),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, 48 layers, 32 heads, 4 kv heads, head_dim
    # 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, norm_topk_prob true, vocab 151936,
    # rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960, router_aux_loss_coef 0.001, untied;
    # every layer sparse: decoder_sparse_step 1, mlp_only_layers []). Its q/k RMSNorms (2 x 128 weights a block)
    # are not modelled.
    "qwen3-30b-a3b": TransformerConfig(
        vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim_override=128, ffn_hidden=6144,
        max_seq_len=40960, norm_eps=1e-6, rope_theta=1e6, tie_embeddings=False, init="llama", n_experts=128,
        moe_top_k=8, moe_hidden=768, aux_loss_coef=0.001,
    ),
    # DeepSeek-V3-style fine-grained MoE (deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, 61 layers, 128
    # heads, vocab 129280, intermediate_size 18432 in the first_k_dense_replace 3 dense blocks, n_routed_experts 256
    # of moe_intermediate_size 2048, num_experts_per_tok 8, n_shared_experts 1, norm_topk_prob true, aux_loss_alpha
    # 0.001, untied). Not V3's: its multi-head latent attention (here plain multi-head attention of 128 heads of
    # 56, 205M weights a block against MLA's ~187M), its sigmoid group-limited router with the bias, and its
    # multi-token-prediction module. Context 4096, V3's pre-training length (DeepSeek-V3 report, section 4.2).
    "deepseek-v3-style": TransformerConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, ffn_hidden=18432, max_seq_len=4096,
        tie_embeddings=False, init="llama", n_experts=256, moe_top_k=8, moe_hidden=2048, n_shared_experts=1,
        moe_first_dense=3, aux_loss_coef=0.001,
    ),
}  # fmt: skip


def transformer_config(
    name: str, vocab_size: int | None = None, max_seq_len: int | None = None, **moe: int | float | None
) -> TransformerConfig:
    """The named size with its vocabulary and context overridden where given (the data decides both), and an MoE
    size's ``moe_top_k`` / ``capacity_factor`` (``moe``: the run's ``--moe-top-k`` / ``--capacity-factor``)."""
    if name not in SIZES:
        raise ConfigError(f"unknown transformer size {name!r}; choose one of: {', '.join(SIZES)}")
    overrides = {"vocab_size": vocab_size, "max_seq_len": max_seq_len, **moe}
    return replace(SIZES[name], **{k: v for k, v in overrides.items() if v is not None}).check()


# ------------------------------------------------------------------------------------------------
# the model


def rotary_angles(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
    scaling: RopeScaling | None = None, start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos and sin of position x frequency, (seq_len, head_dim / 2), for positions ``start`` to ``start +
    seq_len`` (a context-parallel rank's chunk starts past 0), computed afresh in each forward: a buffer would not
    survive building on the meta device, and this costs T x head_dim / 2 elements per block."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    positions = torch.arange(start, start + seq_len, device=device, dtype=dtype)
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent channel pair of ``x`` (batch, seq, heads, head_dim) by its position's angle, in
    ``cos``'s dtype (fp32 at least, as Llama does for bf16), returned in ``x``'s dtype. Adjacent pairs are
    Meta's Llama layout (``view_as_complex``), written out in real numbers for meta tensors and DeepSpeed."""
    x0, x1 = x.to(cos.dtype).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, seq, kv_heads, head_dim) -> (batch, seq, kv_heads * n_rep, head_dim): each key/value head serves
    n_rep consecutive query heads (grouped-query attention, Ainslie et al. 2023)."""
    if n_rep == 1:
        return x
    b, t, h, d = x.shape
    return x[:, :, :, None, :].expand(b, t, h, n_rep, d).reshape(b, t, h * n_rep, d)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions; no biases."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.rotated_qkv(x, self.first_position(t))
        return self.wo(self.attend(q, k, v).reshape(b, t, -1))

    def rotated_qkv(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (batch, seq, heads, head_dim) queries, keys and values of ``x``, whose tokens sit at positions
        ``start`` onwards, the queries and keys rotated there (``forward``; a KV cache's step, ``models.kv_cache``)."""
        b, t, _ = x.shape
        # -1 heads: the projections' output decides, so a tensor-parallel rank (strategies.tp) whose wq/wk/wv
        # compute n_heads / T and n_kv_heads / T heads runs this same code.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        angle_dtype = torch.promote_types(q.dtype, torch.float32)  # fp64 stays fp64, bf16 rotates in fp32
        cos, sin = rotary_angles(t, self.head_dim, self.rope_theta, x.device, angle_dtype, self.rope_scaling, start=start)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def first_position(self, t: int) -> int:
        """The position of the first of the ``t`` tokens this module sees (0: the whole sequence; a
        context-parallel rank's chunk starts later)."""
        return 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (batch, seq, heads, head_dim) queries over keys and values with fewer heads or as
        many (grouped-query), the output (batch, seq, heads, head_dim)."""
        n_rep = q.shape[2] // k.shape[2]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def mlp(cfg: TransformerConfig, layer_id: int) -> FeedForward | MoEFeedForward:
    """Block ``layer_id``'s MLP: dense SwiGLU, or routed experts (``models.moe``) in an MoE model's sparse blocks."""
    if not cfg.is_moe_layer(layer_id):
        return FeedForward(cfg.dim, cfg.ffn_hidden)
    shared = FeedForward(cfg.dim, cfg.n_shared_experts * cfg.moe_hidden) if cfg.n_shared_experts else None
    return MoEFeedForward(
        cfg.dim, cfg.moe_hidden, cfg.n_experts, cfg.moe_top_k, norm_topk_prob=cfg.norm_topk_prob,
        capacity_factor=cfg.capacity_factor, aux_loss_coef=cfg.aux_loss_coef, shared=shared,
    )


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + mlp(norm(.)). Hidden state in, hidden state out, so that
    a pipeline stage boundary can fall between any two blocks."""

    def __init__(self, cfg: TransformerConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id  # llama init scales this block's output projections by its depth
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = mlp(cfg, layer_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (batch, seq) -> embedding -> ``layers`` -> RMSNorm -> head -> logits (batch, seq, vocab)."""

    _stratbench_block_types = (TransformerBlock,)
    """Read by ``zoo.residual_block_types``: the unit of FSDP wrapping and activation checkpointing."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        # The modules' own default inits draw from the generator; rewinding it before ``init_weights`` makes
        # a direct build and a meta build + ``materialize`` draw the same numbers: the same weights per seed.
        rng = torch.get_rng_state()
        self.config = cfg.check()
        self.vocab_size, self.max_seq_len = cfg.vocab_size, cfg.max_seq_len
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        torch.set_rng_state(rng)
        self.init_weights()

    def materialize(self, device: torch.device | str) -> Transformer:
        """A model built on the meta device, given storage on ``device`` and its seeded initial weights: the
        same weights as a direct build under the same seed (on CPU)."""
        self.to_empty(device=device)
        self.tie_weights()
        self.init_weights()
        return self

    def tie_weights(self) -> None:
        """Make the head's weight the embedding's Parameter (one tensor, one gradient) when the config ties
        them; call it again after ``to_empty``, which gives each module its own tensor."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter by the config's scheme (a no-op on the meta device; after ``to_empty``
        it gives the weights a seeded start, the same on every rank)."""
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        (init_gpt2 if self.config.init == "gpt2" else init_llama)(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ConfigError(
                f"the transformer takes token ids of shape (batch, seq), not shape {tuple(tokens.shape)}"
            )
        if tokens.shape[1] > self.max_seq_len:
            raise ConfigError(
                f"a sequence of {tokens.shape[1]} tokens is longer than the model's max_seq_len {self.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# ------------------------------------------------------------------------------------------------
# initialisation


def _mlp_weights(ffn: FeedForward | MoEFeedForward) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the MLP's weights read from the residual stream, its down projections written into it): w1 (with an MoE
    layer's router and stacked w1, and its shared experts' w1) and w2; w3 is in neither (each init places it)."""
    if isinstance(ffn, FeedForward):
        return [ffn.w1.weight], [ffn.w2.weight]
    shared_in, shared_out = _mlp_weights(ffn.shared) if ffn.shared is not None else ([], [])
    return [ffn.router.weight, ffn.w1, *shared_in], [ffn.w2, *shared_out]


def _w3(ffn: FeedForward | MoEFeedForward) -> list[torch.Tensor]:
    if isinstance(ffn, FeedForward):
        return [ffn.w3.weight]
    return [ffn.w3, *(_w3(ffn.shared) if ffn.shared is not None else [])]


def init_gpt2(model: Transformer) -> None:
    """GPT-2 (Radford et al. 2019) as nanoGPT writes it: normal(0, 0.02) for every linear (an MoE layer's stacked
    experts too) and the embedding, and std 0.02 / sqrt(2 n_layers) for the projections into the residual stream
    (attention's wo, the MLP's w2), whose 2 n_layers contributions add up. A tied head is the embedding, drawn once."""
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding) and module.weight is not model.tok_embeddings.weight:
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, MoEFeedForward):
            for weight in (module.w1, module.w3):
                nn.init.normal_(weight, mean=0.0, std=0.02)
    for block in model.layers:
        for weight in (block.attention.wo.weight, *_mlp_weights(block.feed_forward)[1]):
            nn.init.normal_(weight, mean=0.0, std=residual_std)
    nn.init.normal_(model.tok_embeddings.weight, mean=0.0, std=0.02)


def init_llama(model: Transformer) -> None:
    """torchtitan's Llama 3 scheme (torchtitan/models/llama3/model/model.py ``init_weights``, depth_init=True):
    embedding normal(0, 1); wq, wk, wv, w1 trunc_normal(0, 0.02); wo, w2 and w3 of block i
    trunc_normal(0, 0.02 / sqrt(2 (i + 1))) (torchtitan puts w3 with the depth-scaled ones too); output head
    trunc_normal(0, dim^-0.5) cut at 3 std, which makes the initial logits unit-variance after the final norm.
    torchtitan has no tied Llama: a tied matrix takes the head's init, since a unit-variance head would give
    logits of std sqrt(dim), while the embedding's scale is normalised away by each block's pre-norm. An MoE
    layer's router and experts take the dense MLP's stds (its router w1's)."""
    for block in model.layers:
        depth_std = 0.02 / math.sqrt(2 * (block.layer_id + 1))
        attn, ffn = block.attention, block.feed_forward
        inputs, outputs = _mlp_weights(ffn)
        for weight in (attn.wq.weight, attn.wk.weight, attn.wv.weight, *inputs):
            nn.init.trunc_normal_(weight, mean=0.0, std=0.02)
        for weight in (attn.wo.weight, *outputs, *_w3(ffn)):
            nn.init.trunc_normal_(weight, mean=0.0, std=depth_std)
    if not model.config.tie_embeddings:
        nn.init.normal_(model.tok_embeddings.weight, mean=0.0, std=1.0)
    head_std = model.config.dim**-0.5
    nn.init.trunc_normal_(model.output.weight, mean=0.0, std=head_std, a=-3 * head_std, b=3 * head_std)


def build_transformer(
    name: str, vocab_size: int | None = None, max_seq_len: int | None = None, **moe: int | float | None
) -> Transformer:
    """The named size (``SIZES``) with its vocabulary, context and MoE routing (``transformer_config``) overridden
    where given; under ``with torch.device("meta"):`` nothing is allocated (llama-8b builds in seconds)."""
    return Transformer(transformer_config(name, vocab_size, max_seq_len, **moe))


# ------------------------------------------------------------------------------------------------
# counts


def parameter_count(cfg: TransformerConfig, active: bool = False) -> int:
    """Parameters of ``Transformer(cfg)`` from its shape (a tied head counts once); ``active``: those one token
    passes through (an MoE layer's top-k routed experts, not all of them)."""
    # the head, tied or not, is in matmul_parameters; an untied embedding comes on top
    untied_embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    return matmul_parameters(cfg, active) + untied_embedding + norms


def mlp_parameters(cfg: TransformerConfig, layer_id: int, active: bool = True) -> int:
    """Block ``layer_id``'s MLP weights (all take part in a matmul): dense SwiGLU, or the router, the routed experts
    (``active``: the top-k a token reaches, else all) and the shared experts."""
    if not cfg.is_moe_layer(layer_id):
        return 3 * cfg.dim * cfg.ffn_hidden
    experts = cfg.moe_top_k if active else cfg.n_experts
    return cfg.dim * cfg.n_experts + 3 * cfg.dim * cfg.moe_hidden * (experts + cfg.n_shared_experts)


def matmul_parameters(cfg: TransformerConfig, active: bool = True) -> int:
    """Parameters that take part in a matmul: every linear weight including the output head (tied or not: the
    tied head multiplies by the embedding matrix), not the embedding lookup, which is a gather; ``active`` (the
    FLOPs' count): of an MoE layer's routed experts only the top-k a token reaches."""
    qo = 2 * cfg.dim * cfg.n_heads * cfg.head_dim
    kv = 2 * cfg.dim * cfg.n_kv_heads * cfg.head_dim
    mlp = sum(mlp_parameters(cfg, i, active) for i in range(cfg.n_layers))
    return cfg.n_layers * (qo + kv) + mlp + cfg.dim * cfg.vocab_size


def flops_per_token(cfg: TransformerConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_len``:
    ``6 N + 12 n_layers dim seq_len`` (Kaplan et al. 2020, table 1; PaLM, Chowdhery et al. 2022, appendix B).

    N is ``matmul_parameters``, the active ones (2 FLOPs per weight per token forward, 4 backward; a dropless MoE
    layer computes k experts per token whatever the routing, so this is the FLOPs the counter sees). The second term is the
    attention score and value matmuls (QK^T and AV: 2 x 2 x seq_len x dim forward per token per layer, times 3
    for training), counted over the full seq_len x seq_len square, as ``torch.utils.flop_counter`` counts
    ``scaled_dot_product_attention`` on the meta device (its math path), though a causal kernel can skip half.
    Norms, rotary, softmax and the loss (O(dim) per token) are not counted, as the counter does not."""
    if seq_len <= 0:
        raise ConfigError(f"flops_per_token: seq_len must be a positive integer, not {seq_len!r}")
    return 6.0 * matmul_parameters(cfg) + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
