"""What :class:`~lightning_llm.callbacks.CheckpointRotation` does for a run that resumes.

``ckpt_path="last"`` resolves to the newest complete checkpoint that verifies; loads of single files are checked
against their commit marker first (:class:`~lightning_llm.checkpointing.verified_load.VerifiedLoad`, wrapped around
the strategy's ``checkpoint_io`` for one fit); and every rank gets back the random generator states it saved, which
Lightning does not checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_llm._compat.known_warnings import ScopedFilters
from lightning_llm.checkpointing.commit import last_candidate, newest_verified
from lightning_llm.checkpointing.verified_load import VerifiedLoad
from lightning_llm.contract import contract_of

RNG_KEY = "rng_states_per_rank"  # top-level checkpoint key: one generator state per global rank

_NO_LAST_CHECKPOINT = r'.*ckpt_path="last"\) is set, but there is no last checkpoint available.*'


def newest_complete(directory: str, filters: ScopedFilters) -> str | None:
    """What ``ckpt_path="last"`` resolves to in ``directory``: the newest complete checkpoint that verifies, or
    ``None`` (said once: the run starts fresh; Lightning's own notice is filtered by ``filters`` for the fit)."""
    newest = newest_verified(directory)
    if newest is None:
        # Lightning's own notice would advise ModelCheckpoint(save_last=True), which this callback does not need.
        filters.ignore(_NO_LAST_CHECKPOINT)
        rank_zero_info(f"CheckpointRotation: no complete checkpoint in {directory}; ckpt_path='last' starts fresh.")
        return None
    return last_candidate(newest)


def check_loads(trainer: L.Trainer, resolved_last: Callable[[], str | None]) -> None:
    """Verify every load of this fit that goes through the strategy's ``checkpoint_io`` (single files) first;
    ``resolved_last()`` is what ``ckpt_path="last"`` resolved to, verified then."""
    strategy = trainer.strategy
    if contract_of(trainer).loads_through_checkpoint_io and not isinstance(strategy.checkpoint_io, VerifiedLoad):
        strategy.checkpoint_io = VerifiedLoad(strategy.checkpoint_io, strategy, resolved_last)


def stop_checking_loads(trainer: L.Trainer) -> None:
    """The strategy's ``checkpoint_io`` is the user's again once the fit that needed checked loads is over."""
    if isinstance(trainer.strategy.checkpoint_io, VerifiedLoad):
        trainer.strategy.checkpoint_io = trainer.strategy.checkpoint_io.inner


def rng_state_of_rank(trainer: L.Trainer, checkpoint: dict) -> dict[str, Any] | None:
    """This rank's generator states in ``checkpoint``; ``None`` when it holds none for this rank (a run on more
    ranks than saved it: those keep their seeded generators, with a warning)."""
    states = checkpoint.get(RNG_KEY) or []
    if trainer.global_rank < len(states):
        return states[trainer.global_rank]
    if states:
        rank_zero_warn(
            f"The checkpoint holds random generator states of {len(states)} ranks, this run has "
            f"{trainer.world_size}: ranks beyond them keep their seeded generators."
        )
    return None
