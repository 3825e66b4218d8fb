"""Import torchvision even when PyPI's CUDA build of it sits on a CPU-only torch.

PyPI's torchvision wheel is built against CUDA; on a CPU torch its ``_C`` extension cannot register the
``nms``/``qnms`` operators and ``import torchvision`` fails with "operator torchvision::nms does not exist".
Defining the two operator schemas first makes models, datasets and transforms work (only ``ops.nms`` and
``io.decode_jpeg`` stay broken). The fix is applied only when the plain import fails.
"""

from __future__ import annotations

import sys
from types import ModuleType

_LIB = None


def import_torchvision() -> ModuleType:
    global _LIB
    try:
        import torchvision

        return torchvision
    except RuntimeError as exc:
        if "does not exist" not in str(exc):
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision
