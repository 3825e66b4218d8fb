"""CPU seconds per image of the ImageNet training transform that DeepLearningExamples' ConvNets run in their
``pytorch`` data backend (image_classification/dataloaders.py, get_pytorch_train_loader: ImageFolder -> PIL decode,
RandomResizedCrop(224), RandomHorizontalFlip, then fast_collate's uint8 array), measured on this machine: what
hardware.yaml's ``input_pipelines.imagenet-pil`` holds.

    PYTHONPATH=src python benchmarks/input_pipeline_cpu.py [--images 200]

No ImageNet here: the JPEGs are synthetic, at ImageNet's typical size (500 x 375, the most common shape of its
training images) and quality 90 (~110 KB each, about ImageNet's mean file size), with smooth shapes plus noise so
that they do not compress to nothing. The crop follows torchvision's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3,
bilinear resize to 224 x 224) written with PIL directly (this environment's torchvision does not import). CPU time
of this process (``time.process_time``), so other load on the machine does not count; one core.
"""

from __future__ import annotations

import argparse
import io
import math
import platform
import random
import statistics
import time

import numpy as np
from PIL import Image, ImageDraw


def synthetic_jpeg(rng: random.Random, w: int = 500, h: int = 375) -> bytes:
    """A JPEG of ``w`` x ``h`` with shapes and noise (quality 90)."""
    img = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(40):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        box = (x0, y0, x0 + rng.randrange(20, 200), y0 + rng.randrange(20, 200))
        draw.ellipse(box, fill=tuple(rng.randrange(256) for _ in range(3)))
    noise = np.random.default_rng(rng.randrange(1 << 30)).normal(0, 18, (h, w, 3))
    arr = np.clip(np.asarray(img, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def random_resized_crop(img: Image.Image, rng: random.Random, size: int = 224) -> Image.Image:
    """torchvision's RandomResizedCrop.get_params (10 tries, else the centre crop) and a bilinear resize."""
    w, h = img.size
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return img.resize((size, size), Image.BILINEAR, box=(x, y, x + cw, y + ch))
    side = min(w, h)
    x, y = (w - side) // 2, (h - side) // 2
    return img.resize((size, size), Image.BILINEAR, box=(x, y, x + side, y + side))


def one_image(data: bytes, rng: random.Random) -> np.ndarray:
    """Decode, crop, flip half the time, and the uint8 CHW array fast_collate copies."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    img = random_resized_crop(img, rng)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return np.rollaxis(np.asarray(img, dtype=np.uint8), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    jpegs = [synthetic_jpeg(rng) for _ in range(32)]
    for d in jpegs[:4]:
        one_image(d, rng)  # warm-up
    per_image = []
    for _ in range(args.repeats):
        t0 = time.process_time()
        for i in range(args.images):
            one_image(jpegs[i % len(jpegs)], rng)
        per_image.append((time.process_time() - t0) / args.images)
    import PIL

    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"Pillow {PIL.__version__}, numpy {np.__version__}")  # fmt: skip
    print(f"mean JPEG size: {statistics.fmean(map(len, jpegs)) / 1e3:.0f} KB (500 x 375, quality 90)")
    print(f"CPU ms per image, {args.repeats} repeats of {args.images}: "
          + ", ".join(f"{x * 1e3:.2f}" for x in per_image))  # fmt: skip
    print(f"median: {statistics.median(per_image) * 1e3:.2f} ms per image per core")


if __name__ == "__main__":
    main()
