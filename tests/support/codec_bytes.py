"""Layer bytes as the codec tests see them: the layout dtypes by name and the raw bytes of a
tensor."""

from __future__ import annotations

import numpy as np
import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def raw_of(x: torch.Tensor) -> np.ndarray:
    """Raw bytes of a [2, H, n, D] tensor."""
    ints = {2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.contiguous().view(ints).numpy().reshape(-1).view(np.uint8)
