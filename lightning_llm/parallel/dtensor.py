"""The one place a possibly-distributed tensor becomes this rank's plain tensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``to_local()``, differentiable), or ``tensor`` itself when it is plain.

    Example::

        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
