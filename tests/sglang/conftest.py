"""Making SGLang importable on a CPU-only torch.

SGLang's import chain imports torchvision. torchvision's PyPI wheel links its C ops against
CUDA libraries, which do not load next to a CPU build of torch, and a torchvision in the
venv's site-packages breaks vLLM's and transformers' imports; so it is installed aside, in
``.venv/sglang-extra``, and only these tests put it on ``sys.path``. Without its C ops,
torchvision's import still registers fake (meta) kernels for ``torchvision::nms`` and
``torchvision::qnms``, which fails unless those operators exist: their schemas are
declared here first. The ``Library`` object must stay alive for the declarations to last.
On a machine whose torchvision loads normally none of this is done.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_EXTRA = Path(sys.prefix) / "sglang-extra"
_torchvision_schemas = None

if importlib.util.find_spec("torchvision") is None and _EXTRA.is_dir():
    sys.path.append(str(_EXTRA))
    _torchvision_schemas = torch.library.Library("torchvision", "DEF")
    _torchvision_schemas.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_schemas.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
