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


def local_grad_stand_in(grad: torch.Tensor) -> torch.Tensor:
    """A plain tensor whose ``.grad`` is ``grad``'s local shard, for torch routines that read ``param.grad``.

    Both alias the shard's storage, so what such a routine does to the gradient in place (unscale, clip) happens to
    the real gradient; a pending ``Partial`` sum is scaled like the rest, since scaling is linear.

    Example::

        torch.nn.utils.clip_grads_with_norm_([local_grad_stand_in(p.grad) for p in params], 1.0, total_norm)
    """
    local = local_tensor(grad)
    stand_in = local.detach()
    stand_in.grad = local
    return stand_in
