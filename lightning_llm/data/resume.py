"""Mid-epoch resume for any DataModule's training loader: the batches the epoch already trained are skipped by index.

Lightning restores a training loader's position only when the loader itself is stateful (``state_dict`` /
``load_state_dict``). A plain ``DataLoader`` restarts its epoch from the first batch after a mid-epoch resume, so the
run trains those batches twice and never reaches the epoch's last ones (Lightning warns, "not resumable").
:class:`~lightning_llm.data.LLMDataModule` keeps its own position; this covers a user's own DataModule whose order is
a function of the epoch alone: a ``DistributedSampler`` (what Lightning injects in place of ``shuffle=True`` under a
distributed strategy, seeded by ``seed_everything``) or a ``SequentialSampler``, batched by a plain
``BatchSampler``. The restored loop progress says how many batches of which epoch were trained; the loader is rebuilt
(as Lightning rebuilds it to inject its sampler) over a sampler that drops that many samples of that epoch, without
reading them. Resuming with the same data-parallel size and seed is assumed: both decide the epoch's order.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler, SequentialSampler

from lightning_llm._compat.lightning import rebuild_dataloader

log = logging.getLogger(__name__)

# Lightning's hint (a PossibleUserWarning) that a plain loader restarts its epoch: not true of a loader rebuilt here.
RESUMED_MID_EPOCH = "You're resuming from a checkpoint that ended before the epoch ended"


class SkipTrained(Sampler[int]):
    """``sampler`` whose epoch ``epoch`` starts after its first ``samples`` indices; other epochs are unchanged.

    ``len()`` stays the whole epoch: Lightning counts the resumed epoch's batches from its restored progress.

    Example::

        sampler = SkipTrained(DistributedSampler(dataset, num_replicas=2, rank=0), epoch=3, samples=40)
    """

    def __init__(self, sampler: Sampler[int], epoch: int, samples: int) -> None:
        self.sampler, self.resumed_epoch, self.samples = sampler, epoch, samples
        self.epoch = getattr(sampler, "epoch", epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = iter(self.sampler)
        return itertools.islice(indices, self.samples, None) if self.epoch == self.resumed_epoch else indices

    def __len__(self) -> int:
        return len(self.sampler)


def resume_mid_epoch(dataloader: Any, trainer: Any) -> Any:
    """The training ``dataloader`` of a run resumed mid-epoch, continuing where the checkpoint stopped.

    Anything else (not resuming, not training, a stateful loader, an order that depends on more than the epoch) is
    returned unchanged. Called from the strategy's ``process_dataloader``, after Lightning restored the loops; a
    rebuilt loader makes Lightning's :data:`RESUMED_MID_EPOCH` warning untrue, which the strategy filters for the run.

    Example::

        def process_dataloader(self, dataloader):
            return resume_mid_epoch(dataloader, self.lightning_module.trainer)
    """
    position = _trained_in_epoch(trainer)
    if position is None or not _ordered_by_epoch(dataloader):
        return dataloader
    epoch, batches = position
    batch_sampler = dataloader.batch_sampler
    if batches >= len(batch_sampler):  # the checkpoint ended its epoch: Lightning starts the next one as usual
        return dataloader
    skipped = SkipTrained(batch_sampler.sampler, epoch, batches * batch_sampler.batch_size)
    log.info("Resuming epoch %d after its %d trained batches: they are skipped, not read again", epoch, batches)
    return rebuild_dataloader(dataloader, skipped)


def _trained_in_epoch(trainer: Any) -> tuple[int, int] | None:
    loop = trainer.fit_loop
    if not trainer.training or not loop.restarting:
        return None
    batches = loop.epoch_loop.batch_progress.current.ready
    return (loop.epoch_progress.current.processed, batches) if batches else None


def _ordered_by_epoch(dataloader: Any) -> bool:
    if not isinstance(dataloader, DataLoader) or callable(getattr(dataloader, "state_dict", None)):
        return False
    batch_sampler = dataloader.batch_sampler
    return type(batch_sampler) is BatchSampler and type(batch_sampler.sampler) in (
        DistributedSampler,
        SequentialSampler,
    )
