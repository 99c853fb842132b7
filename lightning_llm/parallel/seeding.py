"""One seed for the whole job: ranks whose generators differ take rank 0's seed (as torchtitan does).

Replicas and shards are initialized from each rank's CPU generator, so every rank must start from the same
state. A run seeded the same on every rank (``lightning.seed_everything(42)``) is left exactly as it is;
only when the ranks' generators differ does rank 0 draw a seed, broadcast it, and every rank seed with it.
:func:`agree_on_seed` runs just before the model's own init runs on the ranks (LLMParallelStrategy before it
materializes a meta-device model, DeepSpeed's ZeRO-3 partitioned init), so runs that never initialize there keep
whatever per-rank generators the user chose.
"""

from __future__ import annotations

import hashlib
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

_MAX_SEED = 2**32 - 1  # seed_everything's range (numpy's)


def rng_digest() -> str:
    """A digest of this rank's CPU generator state (what the model's init draws from)."""
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def ranks_agree_on_rng(group=None) -> bool:
    """Whether every rank of ``group`` holds the same CPU generator state (True without a process group)."""
    if not dist.is_initialized():
        return True
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, rng_digest(), group=group)
    return len(set(digests)) == 1


def agree_on_seed(group=None) -> int | None:
    """Seed every rank of ``group`` with rank 0's seed when their generators differ; return it (None if unchanged).

    Ranks that already agree (seeded the same, or all unseeded with torch's default state) are not touched.
    Otherwise the group's first rank draws a seed from the OS (not from a generator, so its own state is not
    consumed before it is replaced), broadcasts it, and every rank calls :func:`lightning.seed_everything`
    with it (torch, numpy, Python's ``random``, and ``PL_GLOBAL_SEED`` for dataloader workers).

    Example::

        dist.init_process_group("gloo")
        torch.manual_seed(dist.get_rank())   # differs per rank
        seed = agree_on_seed()               # now the same on every rank
    """
    if ranks_agree_on_rng(group):
        return None
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box = [int.from_bytes(os.urandom(4), "little") % _MAX_SEED if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    seed = int(box[0])
    L.seed_everything(seed, verbose=False)
    rank_zero_info(
        f"The ranks' random generators differed (no common seed was set): every rank uses rank 0's seed {seed} "
        "(call lightning.seed_everything(seed) on every rank before fit() to choose one)."
    )
    return seed
