"""Data sets (synthetic, digits, cifar10, imagefolder, a user's ``package.module:build``) and the samplers that split them across ranks.

Every method uses the same ``DistributedSampler`` (world size 1 included), so rank r of N sees indices
``perm[r::N]`` and one global batch is the same samples whatever the number of ranks: that is what makes
losses comparable across methods.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from stratbench.core.config import IN_MEMORY_DATA, TrainConfig
from stratbench.core.errors import CheckpointError, ConfigError, DataError, did_you_mean
from stratbench.core.inputs import check_inputs
from stratbench.core.safe_load import restricted_pickle_load
from stratbench.core.torchvision_compat import import_torchvision
from stratbench.core.user_code import call_user, import_builder
from stratbench.data.device import Augment, DeviceBatches, DeviceEvalBatches, InMemorySource
from stratbench.data.instruct import (
    FORMATS,
    FT_SOURCES,
    build_ft_data,
    check_records,
    make_tokenizer,
    read_jsonl,
    tokenizer_path,
)
from stratbench.data.sampling import PaddedEval, ShardSampler, SkipSampler
from stratbench.data.table import check_table, is_table_data, table_data
from stratbench.data.text import (
    TEXT_EVAL_SAMPLES,
    TEXT_SOURCES,
    build_text_data,
    is_ft_data,
    is_text_data,
    token_path,
)
from stratbench.models.hf import is_hf_name, model_folder, vocab_size_of

DATASETS = ("synthetic", "digits", "cifar10", "imagefolder")
DATA_PREFIXES = ("tokens", "jsonl", "hf-dataset", "table")
"""The ``PREFIX:`` forms of ``--data`` (a mistyped one reads as a builder: its import error names the prefix)."""
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


class SampleShape:
    """``is_text`` and ``sample_shape`` of a class with ``seq_len`` (None: images), ``image_size`` and
    ``input_shape`` fields: the data bundle, and the model build the estimate traces."""

    seq_len: int | None
    image_size: int
    input_shape: tuple[int, ...] | None
    """A user's input that is no square image (a row of features): its shape, in floating point."""

    @property
    def is_text(self) -> bool:
        return self.seq_len is not None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One input sample's shape: (seq_len,) token ids, a user's input shape, or (3, H, W) pixels."""
        if self.seq_len is not None:
            return (self.seq_len,)
        return self.input_shape or (3, self.image_size, self.image_size)


@dataclass
class DataBundle(SampleShape):
    """A run's training and validation sets and what the model needs to know of them. Image data: items are
    (image C x H x W, class); ``num_classes`` classes. Text data (``seq_len`` set): items are (tokens, next
    tokens), ``seq_len`` ids each; ``num_classes`` is the vocabulary and ``codec`` turns text into ids and back."""

    train: Dataset
    val: Dataset
    num_classes: int
    class_names: list[str]
    image_size: int
    input_shape: tuple[int, ...] | None = None
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    meta: dict = field(default_factory=dict)
    seq_len: int | None = None
    codec: Any = None
    real_tokens_per_sample: float | None = None
    """Fine-tuning data: the mean unpadded tokens of a training item (None: every item is ``seq_len`` tokens)."""
    tokenizer_file: str | None = None
    """Fine-tuning data: the tokenizer.json it was encoded with (the model folder's where --tokenizer is not given)."""
    multi_input: bool = False
    """A user's items whose input is several tensors (a tuple: ``model(*x)``, a mapping: ``model(**x)``)."""

    @property
    def tokens_per_sample(self) -> float | None:
        """What tokens/s counts per sample: the real (unpadded) tokens; None for images."""
        return self.real_tokens_per_sample if self.real_tokens_per_sample is not None else self.seq_len


def default_image_size(cfg: TrainConfig) -> int:
    return cfg.image_size or (224 if cfg.data == "imagefolder" else 32)


def check_data(cfg: TrainConfig) -> None:
    """Fail before any work starts when the data set is unknown or its folder is missing."""
    if is_ft_data(cfg.data):
        check_ft_data(cfg)
        return
    if is_text_data(cfg.data):
        check_text_data(cfg)
        return
    if is_table_data(cfg.data):
        check_table(cfg.data, cfg.target)
        return
    if cfg.target:
        raise ConfigError(f"--target {cfg.target!r} names a column of --data table:FILE, not of {cfg.data!r}")
    if ":" in cfg.data:
        import_builder(cfg.data, "data", prefixes=DATA_PREFIXES)  # importable now, or one line naming the module
        return
    if cfg.data not in DATASETS:
        raise ConfigError(
            f"unknown data set {cfg.data!r}{did_you_mean(cfg.data, DATASETS + TEXT_SOURCES + FT_SOURCES)}; choose "
            f"one of: {', '.join(DATASETS + TEXT_SOURCES + FT_SOURCES)}, table:FILE (or a builder as "
            "'package.module:function')"
        )
    if cfg.data == "cifar10":
        root = Path(cfg.data_dir or "data")
        if not (root / "cifar-10-batches-py").is_dir() and not cfg.download:
            raise DataError(
                f"CIFAR-10 not found: expected the folder {root / 'cifar-10-batches-py'} "
                f"(extract {CIFAR10_URL} into {root}), or add --download when online"
            )
    if cfg.data == "imagefolder":
        if not cfg.data_dir:
            raise ConfigError("--data imagefolder needs --data-dir DIR (a folder of class subfolders)")
        if not Path(cfg.data_dir).is_dir():
            raise DataError(f"data dir {cfg.data_dir!r} does not exist")


def build_data(cfg: TrainConfig) -> DataBundle:
    check_data(cfg)
    if is_ft_data(cfg.data):
        return _ft_data(cfg)
    if is_text_data(cfg.data):
        return _text_data(cfg)
    if is_table_data(cfg.data):
        t = table_data(cfg.data, str(cfg.target), cfg.val_fraction, cfg.seed)
        n_features = len(t["meta"]["features"])
        return DataBundle(t["train"], t["val"], len(t["classes"]), t["classes"], 0, (n_features,), meta=t["meta"])
    if ":" in cfg.data:
        return _user_data(cfg)
    return {"synthetic": _synthetic, "digits": _digits, "cifar10": _cifar10, "imagefolder": _imagefolder}[
        cfg.data
    ](cfg)


def check_text_data(cfg: TrainConfig) -> None:
    """Text data's files before any work: a tokens:PATH that exists, a tokenizer file that exists."""
    path = token_path(cfg.data, cfg.data_dir) if cfg.data.startswith("tokens") else ""
    if path and not Path(path).exists():
        raise DataError(f"token data {path!r} does not exist (a folder with train.bin and val.bin, or a .bin file)")
    if cfg.data == "text" and cfg.data_dir and not Path(cfg.data_dir).is_dir():
        raise DataError(f"data dir {cfg.data_dir!r} does not exist (a folder of .txt/.md/.py files)")
    if cfg.tokenizer and not Path(cfg.tokenizer).is_file():
        raise DataError(f"tokenizer file {cfg.tokenizer!r} does not exist (a Hugging Face tokenizer.json)")


def check_ft_data(cfg: TrainConfig) -> None:
    """Fine-tuning data before any work: a known format, a file that exists, a tokenizer file that exists."""
    if cfg.data_format not in FORMATS:
        raise ConfigError(f"unknown data_format {cfg.data_format!r}; choose one of: {', '.join(FORMATS)}")
    kind, _, path = cfg.data.partition(":")
    if kind == "jsonl" and not Path(path).is_file():
        raise DataError(f"JSONL file {path!r} does not exist (--data jsonl:PATH, one JSON object a line)")
    if kind == "hf-dataset" and not path:
        raise ConfigError("data 'hf-dataset:' needs a file, a folder or a data set name after the colon")
    if cfg.tokenizer and not Path(cfg.tokenizer).is_file():
        raise DataError(f"tokenizer file {cfg.tokenizer!r} does not exist (a Hugging Face tokenizer.json)")
    if kind == "jsonl":  # read with the standard library: its records are checked here, before any process starts
        folder = model_folder(cfg.model, cfg.download) if is_hf_name(cfg.model) else None
        check_records(read_jsonl(path), cfg.data_format, tokenizer_path(cfg.tokenizer, folder))


def _ft_data(cfg: TrainConfig) -> DataBundle:
    """Fine-tuning examples (data.instruct) with the model's tokenizer (``--tokenizer``, else the Hugging Face
    model folder's tokenizer.json, else bytes), padded per batch or packed into windows of ``--seq-len``."""
    folder = model_folder(cfg.model, cfg.download) if is_hf_name(cfg.model) else None
    tok = make_tokenizer(cfg.tokenizer, folder)
    vocab = cfg.vocab_size if cfg.vocab_size is not None else vocab_size_of(cfg.model) if folder else None
    data = build_ft_data(
        cfg.data, cfg.seq_len, tok, data_format=cfg.data_format, train_on_prompt=cfg.train_on_prompt,
        pack=cfg.pack, val_fraction=cfg.val_fraction, vocab_size=vocab, download=cfg.download,
    )  # fmt: skip
    return DataBundle(
        data.train, data.val, data.vocab_size, [], 0, mean=(), std=(), meta=data.meta, seq_len=data.seq_len,
        codec=data.codec, real_tokens_per_sample=data.tokens_per_sample,
        tokenizer_file=None if tok.source == "bytes" else tok.source,
    )  # fmt: skip


def _text_data(cfg: TrainConfig) -> DataBundle:
    """``text``, ``tokens:PATH`` or ``synthetic-tokens`` (data.text) in windows of ``--seq-len`` tokens; the
    vocabulary plays the part of the classes (the model's output width). A Hugging Face model's vocabulary bounds
    a token file's ids (its embedding has no row for a larger one), checked before the model is built."""
    limit = {}
    if is_hf_name(cfg.model):
        limit = {"max_vocab": vocab_size_of(cfg.model), "max_vocab_of": f"{cfg.model}'s vocabulary"}
    text = build_text_data(
        cfg.data, cfg.seq_len, data_dir=cfg.data_dir, tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction,
        seed=cfg.seed, synthetic_tokens=cfg.synthetic_samples * cfg.seq_len, vocab_size=cfg.vocab_size,
        token_dtype=cfg.token_dtype, **limit,
    )  # fmt: skip
    return DataBundle(
        text.train, text.val, text.vocab_size, [], 0, mean=(), std=(), meta=text.meta, seq_len=text.seq_len,
        codec=text.codec,
    )  # fmt: skip


@dataclass(frozen=True)
class DataShape:
    """What the estimate and the sweep's plan need of a data set without training on it."""

    image_size: int
    input_shape: tuple[int, ...] | None
    classes: int
    train_items: int
    multi_input: bool = False


_DATA_SHAPES: dict[tuple, DataShape] = {}


def user_data_shape(cfg: TrainConfig) -> DataShape:
    """The input shape, classes and training items of ``--data package.module:build`` (or a table file) as a run
    sees them (its first training item, its class names), built once per process and options: the estimate
    traces the batch the run feeds, not a default 32 x 32 of 10 classes (a 12 x 12 data set of 2 classes was
    priced as neither)."""
    key = (cfg.data, cfg.image_size, cfg.data_dir, cfg.seed, cfg.download, cfg.target, cfg.val_fraction)
    if key not in _DATA_SHAPES:
        bundle = build_data(cfg)
        _DATA_SHAPES[key] = DataShape(bundle.image_size, bundle.input_shape, bundle.num_classes, len(bundle.train),
                                      bundle.multi_input)  # fmt: skip
    return _DATA_SHAPES[key]


def is_user_data(spec: str) -> bool:
    """A data builder MODULE:FUNCTION or a table:FILE (a size only building it tells)."""
    return ":" in spec and not is_text_data(spec) and not is_ft_data(spec)


def check_one_batch(cfg: TrainConfig) -> None:
    """A builder's or a table's training set holds at least one global batch: one line before any run (a sweep
    would fail each cell in turn). Built-in data is left to the run."""
    if is_user_data(cfg.data):
        items = user_data_shape(cfg).train_items
        if items < cfg.batch_size:
            raise ConfigError(f"the training set ({items} samples) is smaller than one global batch "
                              f"({cfg.batch_size}): lower --batch-size")  # fmt: skip


def _user_data(cfg: TrainConfig) -> DataBundle:
    """``--data package.module:build``: ``build(**kw)`` returns ``(train, val, class_names)`` (or a DataBundle).

    The builder gets the keywords it declares among ``image_size``, ``data_dir``, ``seed`` and ``download``
    (all of them with ``**kwargs``). Each dataset item is ``(image tensor C x H x W, integer label)``."""
    import inspect

    builder = import_builder(cfg.data, "data", prefixes=DATA_PREFIXES)
    offered = {
        "image_size": cfg.image_size,
        "data_dir": cfg.data_dir,
        "seed": cfg.seed,
        "download": cfg.download,
    }
    params = inspect.signature(builder).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        kwargs = offered
    else:
        kwargs = {p.name: offered[p.name] for p in params if p.name in offered}
    out = call_user(builder, cfg.data, "data", **kwargs)
    if isinstance(out, DataBundle):
        return out
    if not isinstance(out, tuple | list) or len(out) != 3:
        raise DataError(
            f"data {cfg.data!r}: the builder must return (train_dataset, val_dataset, class_names), got "
            f"{type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, tuple | list) else "")
        )
    train, val, names = out
    names = [str(n) for n in names]
    if not names:
        raise DataError(f"data {cfg.data!r}: class_names is empty")
    for split, ds in (("train", train), ("val", val)):
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__") or len(ds) == 0:
            raise DataError(f"data {cfg.data!r}: the {split} dataset is empty or not a map-style Dataset")
    sample = call_user(train.__getitem__, cfg.data, "data: the training set's item", 0)
    if not (isinstance(sample, tuple | list) and len(sample) == 2):
        raise DataError(f"data {cfg.data!r}: items must be (input, label), got {type(sample).__name__}")
    try:
        what = check_inputs(sample[0], f"data {cfg.data!r}")
    except ValueError as exc:
        raise DataError(str(exc)) from None
    if not torch.is_tensor(sample[0]):  # several tensors: model(*x) or model(**x), shapes the model's own business
        return DataBundle(train, val, len(names), names, 0, meta={"builder": cfg.data, "input": what},
                          multi_input=True)  # fmt: skip
    return DataBundle(train, val, len(names), names, *_input_shape(cfg, sample[0]), meta={"builder": cfg.data})


def _input_shape(cfg: TrainConfig, x: torch.Tensor) -> tuple[int, tuple[int, ...] | None]:
    """(image size, input shape) of a data set's first input: a square C x H x W image is an image of H (as the
    built-in image data: --image-size and the image paths apply); any other tensor (a row of features, a
    sequence of vectors) is traced, materialised and counted at its own shape, in floating point."""
    if x.dim() == 3 and x.shape[-1] == x.shape[-2]:
        return cfg.image_size or int(x.shape[-1]), None
    if not x.is_floating_point():
        raise DataError(f"data {cfg.data!r}: an input of shape {tuple(x.shape)} must be floating point (token ids "
                        "are --data text / tokens:PATH), got {x.dtype}")  # fmt: skip
    return 0, tuple(int(d) for d in x.shape)


class SyntheticImages(Dataset):
    """Random images and labels from a fixed seed; a small bank of images is reused so that generating
    data never limits throughput."""

    def __init__(self, n: int, image_size: int, num_classes: int, seed: int, bank: int = 256) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.images = torch.randn(min(n, bank), 3, image_size, image_size, generator=g)
        self.labels = torch.randint(0, num_classes, (n,), generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.images[i % len(self.images)], self.labels[i]


def _synthetic(cfg: TrainConfig) -> DataBundle:
    size = default_image_size(cfg)
    train = SyntheticImages(cfg.synthetic_samples, size, cfg.num_classes, cfg.seed)
    val = SyntheticImages(max(cfg.synthetic_samples // 4, 1), size, cfg.num_classes, cfg.seed + 1)
    names = [f"class_{i}" for i in range(cfg.num_classes)]
    return DataBundle(train, val, cfg.num_classes, names, size, mean=(0.0,) * 3, std=(1.0,) * 3)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``load_digits`` returns them (images 1797 x 8 x 8, targets), read from the file
    scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, found without importing scikit-learn):
    ``import sklearn.datasets`` pulls in scipy and pandas, ~1.8 s of every process that trains on digits, for
    one np.loadtxt. Where that file is not found (another scikit-learn layout), ``load_digits`` itself."""
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec else []
    found = [Path(r) / "datasets" / "data" / "digits.csv.gz" for r in roots]
    found = [f for f in found if f.is_file()]
    if not found:
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target
    data = np.loadtxt(found[0], delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _digits(cfg: TrainConfig) -> DataBundle:
    """scikit-learn's 1,797 real 8x8 digits, bilinearly resized to image_size and repeated to 3 channels."""
    size = default_image_size(cfg)
    images, targets = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    mean, std = x.mean().item(), x.std().item()
    x = ((x - mean) / std).repeat(1, 3, 1, 1).contiguous()
    y = torch.tensor(targets, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))  # fixed split, not --seed
    n_val = int(round(len(x) * cfg.val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return DataBundle(
        TensorDataset(x[train_idx], y[train_idx]),
        TensorDataset(x[val_idx], y[val_idx]),
        10,
        [str(i) for i in range(10)],
        size,
        mean=(mean,) * 3,
        std=(std,) * 3,
        meta={"digits_raw_mean": mean, "digits_raw_std": std},
    )


def _cifar10(cfg: TrainConfig) -> DataBundle:

    T = import_torchvision().transforms
    size = default_image_size(cfg)
    resize = [T.Resize(size, antialias=True)] if size != 32 else []
    norm = [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), *resize, *norm])
    val_tf = T.Compose([*resize, *norm])
    root = cfg.data_dir or "data"
    train = cifar10_dataset(root, True, train_tf, cfg.download)
    val = cifar10_dataset(root, False, val_tf, False)
    return DataBundle(train, val, 10, list(train.classes), size, mean=CIFAR10_MEAN, std=CIFAR10_STD)


def cifar10_dataset(root: str, train: bool, transform, download: bool = False):
    """torchvision's CIFAR10 dataset (its items, transforms and download, which checks the archive's md5) over
    the ``cifar-10-batches-py`` files read with the restricted unpickler: the folder is the user's, so its
    pickles may hold numpy arrays and plain containers, nothing that runs code (torchvision itself calls
    ``pickle.load`` on them, trusting only their md5 sums, which a re-packed copy does not match)."""
    import numpy as np

    cls = import_torchvision().datasets.CIFAR10
    if download:
        cls(root, train=train, download=True)  # fetches and md5-checks the official archive
    folder = Path(root) / cls.base_folder
    try:
        batches = [
            restricted_pickle_load(folder / name, "latin1")
            for name, _ in (cls.train_list if train else cls.test_list)
        ]
        meta = restricted_pickle_load(folder / cls.meta["filename"], "latin1")
        data = np.vstack([b["data"] for b in batches]).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))
        targets = [int(t) for b in batches for t in b.get("labels", b.get("fine_labels", []))]
        classes = [str(c) for c in meta[cls.meta["key"]]]
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataError(f"CIFAR-10 under {str(root)!r} could not be read: {exc}") from None
    if len(targets) != len(data) or not classes:
        raise DataError(f"CIFAR-10 under {str(root)!r}: {len(data)} images but {len(targets)} labels")
    dataset = cls.__new__(cls)  # torchvision's class, filled here instead of by its pickle.load
    VisionDataset = import_torchvision().datasets.VisionDataset
    VisionDataset.__init__(dataset, str(root), transform=transform)
    dataset.train, dataset.data, dataset.targets, dataset.classes = train, data, targets, classes
    dataset.class_to_idx = {c: i for i, c in enumerate(classes)}
    return dataset


def image_transforms(size: int, mean, std, train: bool):

    T = import_torchvision().transforms
    if train:
        ops = [T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()]
    else:
        ops = [T.Resize(int(size * 256 / 224), antialias=True), T.CenterCrop(size)]
    return T.Compose([*ops, T.ToTensor(), T.Normalize(mean, std)])


def _imagefolder(cfg: TrainConfig) -> DataBundle:
    """DIR/train and DIR/val if both exist, else DIR's class folders with a fixed val split."""

    tv = import_torchvision()
    root = Path(cfg.data_dir or ".")
    size = default_image_size(cfg)
    train_tf = image_transforms(size, IMAGENET_MEAN, IMAGENET_STD, train=True)
    val_tf = image_transforms(size, IMAGENET_MEAN, IMAGENET_STD, train=False)
    try:
        if (root / "train").is_dir() and (root / "val").is_dir():
            train = tv.datasets.ImageFolder(root / "train", transform=train_tf)
            val = tv.datasets.ImageFolder(root / "val", transform=val_tf)
            classes = train.classes
        else:
            full_train = tv.datasets.ImageFolder(root, transform=train_tf)
            full_val = tv.datasets.ImageFolder(root, transform=val_tf)
            perm = torch.randperm(len(full_train), generator=torch.Generator().manual_seed(1234)).tolist()
            n_val = max(1, int(round(len(perm) * cfg.val_fraction)))
            train = torch.utils.data.Subset(full_train, perm[n_val:])
            val = torch.utils.data.Subset(full_val, perm[:n_val])
            classes = full_train.classes
    except (FileNotFoundError, RuntimeError) as exc:
        raise DataError(f"image folder {str(root)!r}: {exc}") from None
    return DataBundle(train, val, len(classes), list(classes), size, mean=IMAGENET_MEAN, std=IMAGENET_STD)


def train_loader(
    ds: Dataset,
    micro_batch: int,
    rank: int,
    world: int,
    seed: int,
    workers: int,
    pin: bool,
    step_samples: int = 1,
    chunks: int = 1,
) -> tuple[DataLoader, SkipSampler]:
    """Training micro-batches of ``micro_batch`` samples for ``rank`` of ``world``; each step's
    ``step_samples`` come in the order ``virtual_rank_order`` gives them for ``chunks`` micro-batches."""
    base = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    sampler = SkipSampler(base, step_samples, chunks)
    loader = DataLoader(
        ds,
        batch_size=micro_batch,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
        collate_fn=getattr(ds, "collate", None),  # examples of their own lengths: padded per batch
    )
    return loader, sampler


def val_loader(ds: Dataset, batch: int, rank: int, world: int, workers: int, pin: bool) -> DataLoader:
    return DataLoader(
        PaddedEval(ds),
        batch_size=batch,
        sampler=ShardSampler(len(ds), rank, world),
        num_workers=workers,
        pin_memory=pin,
        collate_fn=getattr(_unwrapped(ds), "collate", None),
    )


def _unwrapped(ds: Dataset) -> Dataset:
    """The data set under a ``Subset`` (``--eval-samples``)."""
    return _unwrapped(ds.dataset) if isinstance(ds, torch.utils.data.Subset) else ds


def steps_per_epoch(n_train: int, world: int, micro_batch: int, grad_accum: int) -> int:
    per_rank = n_train // world
    return (per_rank // micro_batch) // grad_accum


def split_batch(global_batch: int, dp_size: int, grad_accum: int) -> int:
    """Per-device micro-batch; error when the global batch does not divide."""
    denom = dp_size * grad_accum
    if global_batch % denom:
        raise ConfigError(
            f"batch_size {global_batch} is the global batch and must divide by world size x grad_accum "
            f"= {dp_size} x {grad_accum} = {denom}; try {max(denom, global_batch // denom * denom)}"
        )
    return global_batch // denom


# ------------------------------------------------------------------------------------------------
# the device pipeline (stratbench.data.device): which data sets it serves, and the one call the engine makes


def in_memory_source(cfg: TrainConfig, ds: Dataset, train: bool):
    """The data set as tensors plus the augmentation its loader transforms perform (``data.device``), or None
    where the data set is not held in memory (imagefolder decodes files)."""

    if cfg.data == "synthetic" and isinstance(ds, SyntheticImages):
        return InMemorySource(ds.images, ds.labels, Augment(), bank=True)  # no transforms: raw tensors
    if cfg.data == "digits" and isinstance(ds, TensorDataset):
        return InMemorySource(ds.tensors[0], ds.tensors[1], Augment())  # resized and normalised at load
    if cfg.data == "cifar10" and hasattr(ds, "data") and hasattr(ds, "targets"):
        # _cifar10's transforms: train RandomCrop(32, padding=4), RandomHorizontalFlip(), [Resize], ToTensor,
        # Normalize; val [Resize], ToTensor, Normalize. The uint8 images stay uint8 until the device.
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        size = default_image_size(cfg)
        aug = Augment(
            crop_padding=4 if train else 0,
            flip=train,
            resize=None if size == 32 else size,
            scale=1 / 255,
            mean=CIFAR10_MEAN,
            std=CIFAR10_STD,
        )
        return InMemorySource(images, torch.as_tensor(ds.targets, dtype=torch.long), aug)
    return None


def select_pipeline(cfg: TrainConfig, device: torch.device, source_bytes: int | None = None) -> str:
    """'device' or 'loader' for this run. auto: device on CUDA for an in-memory data set that takes at most a
    quarter of the device's memory (``source_bytes``), loader elsewhere (on CPU the loader is what was
    measured and tested; the device pipeline runs there when asked for)."""

    if cfg.data_pipeline == "device":
        if cfg.data not in IN_MEMORY_DATA:
            raise ConfigError(
                f"data_pipeline 'device' needs an in-memory data set ({', '.join(IN_MEMORY_DATA)}), got data "
                f"{cfg.data!r}; use data_pipeline loader or auto"
            )
        return "device"
    if cfg.data_pipeline == "loader" or device.type != "cuda" or cfg.data not in IN_MEMORY_DATA:
        return "loader"
    if source_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        if source_bytes > total // 4:
            return "loader"
    return "device"


def make_train_batches(
    cfg: TrainConfig,
    bundle: DataBundle,
    device: torch.device,
    rank: int,
    world: int,
    micro: int,
    chunks: int | None = None,
):
    """(batches, sampler): iterating ``batches`` yields (x, y) micro-batches; ``sampler.set_epoch(epoch,
    skip=samples_to_skip)`` starts an epoch. One step's ``grad_accum`` micro-batches hold its samples split as
    ``chunks`` data-parallel ranks would take them (default ``cfg.grad_accum``; a pipeline passes its
    micro-batch count: ``virtual_rank_order``). The device pipeline's tensors are already on ``device`` (the
    engine's ``.to(device, non_blocking=True)`` is then a no-op); the loader's are pinned on CUDA."""
    chunks = chunks or cfg.grad_accum
    step_samples = micro * cfg.grad_accum
    source = _device_source(cfg, bundle.train, device, train=True)
    if source is not None:
        batches = DeviceBatches(
            source, micro, rank, world, cfg.seed, device, channels_last=cfg.channels_last,
            step_samples=step_samples, chunks=chunks,
        )  # fmt: skip
        return batches, batches
    pin = cfg.pin_memory and device.type == "cuda"
    return train_loader(
        bundle.train, micro, rank, world, cfg.seed, cfg.num_workers, pin, step_samples, chunks
    )


def make_val_batches(
    cfg: TrainConfig, bundle: DataBundle, device: torch.device, rank: int, world: int, batch: int
):
    """Evaluation batches (x, y, valid) with ``ShardSampler``'s order, from the pipeline training uses."""
    source = None if cfg.eval_samples else _device_source(cfg, bundle.val, device, train=False)
    if source is not None:  # (a subset, --eval-samples, is read by the loader)
        return DeviceEvalBatches(source, batch, rank, world, device, channels_last=cfg.channels_last)
    pin = cfg.pin_memory and device.type == "cuda"
    return val_loader(eval_subset(cfg, bundle), batch, rank, world, cfg.num_workers, pin)


def eval_subset(cfg: TrainConfig, bundle: DataBundle) -> Dataset:
    """The validation samples evaluated: the first ``--eval-samples`` (text data: ``TEXT_EVAL_SAMPLES`` unless
    told), else all."""
    limit = cfg.eval_samples or (TEXT_EVAL_SAMPLES if bundle.is_text else None)
    if limit is None or limit >= len(bundle.val):
        return bundle.val
    return torch.utils.data.Subset(bundle.val, range(limit))


def _device_source(cfg: TrainConfig, ds: Dataset, device: torch.device, train: bool):
    """The in-memory source when the device pipeline serves this run, else None (the loader does)."""
    if select_pipeline(cfg, device) == "loader":
        return None
    source = in_memory_source(cfg, ds, train)
    if source is None:
        if cfg.data_pipeline == "device":
            raise DataError(
                f"data_pipeline 'device': the {cfg.data} data set is not held in memory as tensors"
            )
        return None
    return source if select_pipeline(cfg, device, source.nbytes) == "device" else None


def pipeline_of(batches) -> str:
    """'device' or 'loader': which pipeline ``make_train_batches``/``make_val_batches`` chose (for result.json)."""

    return "device" if isinstance(batches, DeviceBatches | DeviceEvalBatches) else "loader"
