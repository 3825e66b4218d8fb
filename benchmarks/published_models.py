"""The models of src/stratbench/measuring/published.yaml that stratbench does not build itself, as model builders
(``--model published_models:bert_large_s128``), so that the projection can count their FLOPs and parameters.

ResNeXt-101 32x4d as NVIDIA/DeepLearningExamples PyTorch/Classification/ConvNets/image_classification/models/resnet.py
builds it (Bottleneck layers [3, 4, 23, 3], widths [128, 256, 512, 1024], expansion 2, cardinality 32): torchvision's
ResNet with groups=32 and width_per_group=4 has the same shapes.

stratbench's models take an image batch (N, 3, H, W); these read the first ``seq_len`` values of each sample as
token ids (all zero: what matters here is the shapes, counted on the meta device, not what the model computes), and
flatten their per-token logits into one row per sample for the cross-entropy the FLOP counter runs. Shapes as the
sources give them: BERT-large from NVIDIA/DeepLearningExamples PyTorch/LanguageModeling/BERT/bert_configs/large.json
(24 layers, hidden 1024, 16 heads, intermediate 4096, vocabulary 30522, 512 positions, 2 token types; the MLM
decoder tied to the word embeddings and run on the masked positions only, modeling.py BertPreTrainingHeads with
sequence_output_is_dense, at most max_predictions_per_seq = 20 / 80 of them at length 128 / 512,
scripts/run_pretraining.sh); Llama 3 8B from pytorch/torchtitan
torchtitan/models/llama3/__init__.py (dim 4096, 32 layers, 32 heads, 8 KV heads, FFN hidden
compute_ffn_hidden_dim(4096, multiple_of=1024, ffn_dim_multiplier=1.3) = 14336) and model.py (vocabulary 128256,
untied output); Llama 3 70B from the same file (dim 8192, 80 layers, 64 heads, 8 KV heads, FFN hidden
compute_ffn_hidden_dim(8192, multiple_of=4096, ffn_dim_multiplier=1.3) = 28672, vocabulary 128256, untied output).
The ZeRO++ paper's 18B GPT (Wang et al. 2023; the DeepSpeed ZeRO++ tutorial, microsoft/DeepSpeed
docs/_tutorials/zeropp.md, runs it through Megatron-DeepSpeed's GPT-2 code: --num-layers 40 --hidden-size 6144
--num-attention-heads 32 --seq-length 512): GPT-2's pre-norm causal layers (LayerNorm, GELU MLP of 4 x hidden,
biases), learned positions, GPT-2's 50,257-token vocabulary, the output tied to the word embeddings. The paper's
49B, 91B and 138B models are not built here: no source these tools reach gives their shapes. MosaicML's MPT-7B and
13B from mosaicml/llm-foundry's pretraining configs (the same GPT layout).
Differences that move FLOPs and parameters by less than 1%: no NSP head and pooler, no rotary embedding.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torchvision.models import efficientnet_b0 as tv_efficientnet_b0
from torchvision.models import efficientnet_b4 as tv_efficientnet_b4
from torchvision.models.resnet import Bottleneck, ResNet


class Block(nn.Module):
    """A pre-norm transformer layer: attention (grouped-query where ``kv_heads`` < ``heads``) and an MLP (SwiGLU
    where ``gated``)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, gated: bool, causal: bool) -> None:
        super().__init__()
        bias = not gated  # BERT's layers have biases, Llama's none
        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, dim // heads, causal
        norm = nn.RMSNorm if gated else nn.LayerNorm
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.q = nn.Linear(dim, dim, bias=bias)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)
        self.up = nn.Linear(dim, hidden * (2 if gated else 1), bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = (t.transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        h = self.up(self.norm2(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + self.down(h)


class TokenModel(nn.Module):
    """Embeddings, ``layers`` blocks, a final norm and a per-token head (``head_out`` outputs, or the vocabulary,
    tied to the embeddings where ``tie``)."""

    def __init__(self, seq_len: int, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int,
                 gated: bool, positions: int = 0, head_out: int = 0, tie: bool = False, predictions: int = 0,
                 causal: bool | None = None, token_types: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.seq_len, self.predictions = seq_len, predictions
        self.embed = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(positions, dim) if positions else None
        self.types = nn.Embedding(2, dim) if positions and token_types else None
        # Llama's layers are causal, BERT's not, GPT's (given) are
        causal = gated if causal is None else causal
        self.blocks = nn.ModuleList(
            Block(dim, heads, kv_heads, hidden, gated, causal=causal) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(dim) if gated else nn.LayerNorm(dim)
        self.transform = None if gated or head_out else nn.Linear(dim, dim)  # BERT's MLM head transform
        self.head = nn.Linear(dim, head_out or vocab, bias=not gated)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = torch.zeros_like(images.flatten(1)[:, : self.seq_len], dtype=torch.long)
        x = self.embed(tokens)
        if self.positions is not None:
            x = x + self.positions.weight[: self.seq_len]
        if self.types is not None:
            x = x + self.types.weight[0]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.predictions:  # the MLM head sees the masked positions only
            x = x[:, : self.predictions]
        if self.transform is not None:
            x = F.gelu(self.transform(x))
        return self.head(x).flatten(1)


def _bert(seq_len: int, head_out: int = 0, predictions: int = 0) -> nn.Module:
    return TokenModel(seq_len, 30522, 1024, 24, 16, 16, 4096, gated=False, positions=512, head_out=head_out,
                      tie=not head_out, predictions=predictions)  # fmt: skip


def bert_large_s128(num_classes: int = 0) -> nn.Module:
    """BERT-large pre-training at sequence length 128, 20 masked positions (``num_classes`` is ignored: the head is
    the MLM decoder)."""
    return _bert(128, predictions=20)


def bert_large_s512(num_classes: int = 0) -> nn.Module:
    """BERT-large pre-training at sequence length 512, 80 masked positions."""
    return _bert(512, predictions=80)


def bert_large_squad(num_classes: int = 0) -> nn.Module:
    """BERT-large with the SQuAD span head (start and end logits per token) at sequence length 384."""
    return _bert(384, head_out=2)


def llama3_8b(num_classes: int = 0) -> nn.Module:
    """Llama 3 8B at sequence length 8192 (torchtitan's llama3_8b.toml)."""
    return TokenModel(8192, 128256, 4096, 32, 32, 8, 14336, gated=True)


def llama3_70b(num_classes: int = 0) -> nn.Module:
    """Llama 3 70B at sequence length 8192 (torchtitan's shapes)."""
    return TokenModel(8192, 128256, 8192, 80, 64, 8, 28672, gated=True)


def llama3_8b_s2048(num_classes: int = 0) -> nn.Module:
    """Llama 3 8B at sequence length 2048 (the scaling picture's small-batch regime)."""
    return TokenModel(2048, 128256, 4096, 32, 32, 8, 14336, gated=True)


def llama3_70b_s2048(num_classes: int = 0) -> nn.Module:
    """Llama 3 70B at sequence length 2048."""
    return TokenModel(2048, 128256, 8192, 80, 64, 8, 28672, gated=True)


GPT_SHAPES = {"gpt_18b_s512": {"layers": 40, "hidden": 6144, "heads": 32, "vocab": 50257, "seq_len": 512}}
"""The ZeRO++ paper's GPT models whose shapes a source gives (the DeepSpeed ZeRO++ tutorial's 18B)."""


def _gpt(layers: int, hidden: int, heads: int, vocab: int, seq_len: int) -> nn.Module:
    """A GPT-2-style causal model: LayerNorm, GELU MLP of 4 x hidden, learned positions, output tied to the
    word embeddings."""
    return TokenModel(seq_len, vocab, hidden, layers, heads, heads, 4 * hidden, gated=False, positions=seq_len,
                      tie=True, causal=True, token_types=False)  # fmt: skip


def gpt_18b_s512(num_classes: int = 0) -> nn.Module:
    """The ZeRO++ paper's 18B GPT (40 layers, hidden 6144, 32 heads) at sequence length 512."""
    return _gpt(**GPT_SHAPES["gpt_18b_s512"])


def mpt_7b_s2048(num_classes: int = 0) -> nn.Module:
    """MosaicML's MPT-7B (llm-foundry scripts/train/yamls/pretrain/mpt-7b.yaml: d_model 4096, 32 heads, 32 layers,
    expansion ratio 4, vocabulary 50368) at 2048 tokens. Its benchmark table's parameter counts grow by seq x
    d_model with the sequence: learned positions, as here. Its layers have no biases (these do: < 0.1%)."""
    return _gpt(32, 4096, 32, 50368, 2048)


def mpt_13b_s2048(num_classes: int = 0) -> nn.Module:
    """MosaicML's MPT-13B (mpt-13b.yaml: d_model 5120, 40 heads, 40 layers, expansion ratio 4, vocabulary 50368)."""
    return _gpt(40, 5120, 40, 50368, 2048)


def megatron_flops_per_sequence(builder: str) -> float:
    """FLOPs per sequence as Megatron-DeepSpeed's training log counts its "TFLOPs" with activation checkpointing
    (forward, recomputed forward, backward: 96 s l h^2 (1 + s / 6h + V / 16 l h), training.py throughput
    calculation): what the ZeRO++ paper's TFLOPs per GPU are in. Checked on the ZeRO++ tutorial's own log
    (docs/assets/images/zeropp/ZeRO-baseline.png: 64 GPUs, 6.428 samples/s of 512 tokens, "TFLOPs: 7.65"):
    7.65e12 x 64 / 6.428 = 7.62e13 per sequence, this formula 7.62e13."""
    g = GPT_SHAPES[builder]
    s, layers, h, v = g["seq_len"], g["layers"], g["hidden"], g["vocab"]
    return 96 * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


def resnext101_32x4d(num_classes: int = 1000) -> nn.Module:
    """ResNeXt-101 32x4d (DeepLearningExamples' ConvNets)."""
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes=num_classes, groups=32, width_per_group=4)


class SEBottleneck(Bottleneck):
    """DeepLearningExamples' SE bottleneck (image_classification/models/resnet.py Bottleneck with se=True,
    se_squeeze=16; models/common.py SqueezeAndExcitation): the block's output scaled per channel by a sigmoid of
    Linear(C, 16) -> ReLU -> Linear(16, C) over its spatial mean, added to the residual (fused_se: addcmul)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        channels = self.conv3.out_channels
        self.squeeze, self.expand = nn.Linear(channels, 16), nn.Linear(16, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        residual = x if self.downsample is None else self.downsample(x)
        scale = torch.sigmoid(self.expand(F.relu(self.squeeze(out.mean((2, 3))))))
        return self.relu(torch.addcmul(residual, out, scale[:, :, None, None]))


def se_resnext101_32x4d(num_classes: int = 1000) -> nn.Module:
    """SE-ResNeXt-101 32x4d (DeepLearningExamples' ConvNets: ResNeXt-101 32x4d's shapes with SE bottlenecks)."""
    return ResNet(SEBottleneck, [3, 4, 23, 3], num_classes=num_classes, groups=32, width_per_group=4)


def efficientnet_b0(num_classes: int = 1000) -> nn.Module:
    """EfficientNet-B0 (DeepLearningExamples' ConvNets efficientnet: the paper's MBConv stages, width and depth
    1.0; torchvision's builder has the same shapes)."""
    return tv_efficientnet_b0(num_classes=num_classes)


def efficientnet_b4(num_classes: int = 1000) -> nn.Module:
    """EfficientNet-B4 (width 1.4, depth 1.8; trained at 380 px in DeepLearningExamples' configs.yml)."""
    return tv_efficientnet_b4(num_classes=num_classes)


SEQ_LEN = {"bert_large_s128": 128, "bert_large_s512": 512, "bert_large_squad": 384, "llama3_8b": 8192,
           "llama3_70b": 8192, "gpt_18b_s512": 512, "llama3_8b_s2048": 2048, "llama3_70b_s2048": 2048,
           "mpt_7b_s2048": 2048, "mpt_13b_s2048": 2048}  # fmt: skip
"""Tokens per sample of each builder: the image side must hold them (3 x H x W >= seq_len)."""
