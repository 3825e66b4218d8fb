"""Import torchvision even when PyPI's CUDA build of it sits on a CPU-only torch — for stratbench's own imports
and for every module of the user's (``--model mynet:build`` whose ``mynet.py`` does ``import torchvision``).

PyPI's torchvision wheel is built against CUDA; on a CPU torch its ``_C`` extension cannot load, so the
``nms``/``qnms`` operators are never defined and ``import torchvision`` fails in its fake-tensor registrations
with "operator torchvision::nms does not exist". Defining the two operator schemas first makes models, datasets
and transforms work (only ``ops.nms`` and ``io.decode_jpeg`` stay broken). They are defined only when ``_C``
cannot load (the same test torchvision's ``extension.py`` makes), so a matching CPU or CUDA build is untouched.

:func:`guard_torchvision_import` puts a finder first on ``sys.meta_path`` that makes that check the first time
anything imports torchvision, then steps aside: importing torchvision costs seconds, which a run whose user code
never imports it should not pay.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

_LIB = None  # the torch.library.Library that holds the two schemas (kept alive: dropping it undefines them)


def _define_missing_ops() -> None:
    """Define torchvision's ``nms``/``qnms`` schemas when its compiled ``_C`` cannot load (once)."""
    global _LIB
    if _LIB is not None or "torchvision" in sys.modules:
        return
    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the import fails as Python says
    folder = Path(next(iter(spec.submodule_search_locations)))
    libs = sorted(folder.glob("_C.*"))
    if not libs:
        return
    import torch

    try:
        torch.ops.load_library(str(libs[0]))
        return  # a build that matches this torch: it registers its own operators
    except (ImportError, OSError):
        pass
    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _TorchvisionGuard(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: on the first ``import torchvision`` (anyone's), define the missing operators if
    needed, leave ``sys.meta_path`` and let the normal finders import it."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 (importlib's signature)
        if fullname == "torchvision":
            _unguard()
            _define_missing_ops()
        return None


_GUARD = _TorchvisionGuard()


def _unguard() -> None:
    if _GUARD in sys.meta_path:
        sys.meta_path.remove(_GUARD)


def guard_torchvision_import() -> None:
    """Make a later ``import torchvision`` work on a CPU torch whatever imports it (stratbench, the user's model
    or data module, transformers); costs nothing until then. Idempotent."""
    if "torchvision" in sys.modules or _GUARD in sys.meta_path:
        return
    sys.meta_path.insert(0, _GUARD)


def import_torchvision() -> ModuleType:
    """torchvision, through the guard."""
    guard_torchvision_import()
    import torchvision

    return torchvision
