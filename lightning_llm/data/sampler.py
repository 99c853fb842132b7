"""A distributed sampler that shuffles by (seed, epoch) and can resume mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` without padding, plus a resume position.

    Each epoch's order is a permutation seeded by ``seed + epoch``; rank ``r`` of ``n``
    takes every n-th index starting at ``r``. The tail that does not divide evenly is dropped
    (rather than padded with duplicates), so no sample is seen twice in an epoch.
    ``resume(epoch, samples)`` skips the first ``samples`` indices of this rank in that
    epoch: a resumed run continues with the next batch.

    ``len()`` is always the full epoch, also while a skip is pending. Lightning reads the length
    once (as ``num_training_batches`` for every later epoch) and counts the resumed epoch's batches
    from the restored ``batch_progress``: a shortened length would end the resumed epoch early and
    shorten every later one. This is the contract of torchdata's ``StatefulDataLoader`` too; a
    sampler is kept rather than that loader because the position must be global (samples of all
    data-parallel ranks), so a run can resume with a different data-parallel size, while the
    loader's state counts one rank's samples and Lightning checkpoints rank 0's state only.

    Measured with torchdata 0.11.0 (torch 2.13): two ranks, each a ``StatefulDataLoader`` over a
    ``DistributedSampler`` of 32 samples, batch 2, three batches each (12 samples trained). Rank 0's
    state is ``{"_sampler_iter_state": {"samples_yielded": 6}, "_num_yielded": 3, ...}``; loaded into a
    one-rank loader it skips the first 6 samples of the one-rank order and yields 26 more, 6 of which
    were already trained (38 reads of 32 samples). Keeping the property would take a sampler with its
    own global ``state_dict`` under that loader, that is this sampler, so the loader adds nothing here.

    Being a ``DistributedSampler``, Lightning leaves it in place instead of injecting its own.
    """

    def __init__(self, dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, samples: int) -> None:
        """Skip the first ``samples`` of this rank's share when iterating ``epoch``."""
        self._resume = (epoch, samples)

    def _skip(self) -> int:
        return self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self._skip() :]
        self._resume = None
        return iter(indices)
