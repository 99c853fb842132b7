"""What Lightning's resume overrides: the optimizers' hyperparameters (the learning rate first) and the schedulers'.

On ``fit(ckpt_path=...)`` Lightning restores each optimizer's state, its parameter groups' ``lr``, ``initial_lr``,
``weight_decay``, ... included, and each scheduler's state over what ``configure_optimizers`` just built. A learning
rate or schedule changed for the resumed run is so replaced by the checkpoint's, which is Lightning's rule; here the
values are read once after the optimizers are built (:func:`remember`) and once after the restore (:func:`report`),
and where they differ one warning says which value won and how to change it.

Example::

    remember(trainer)          # after the optimizers are built, before the checkpoint's state is restored
    ...
    report(trainer)            # at train start: "Resumed from ...: learning rate 0.0003 (configured 0.001) ..."
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

# A scheduler's position, not a setting: it is meant to come back from the checkpoint. ``base_lrs`` is the
# optimizer's ``initial_lr``, said once there.
_PROGRESS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial", "base_lrs"}
_PLAIN = (int, float, str, bool, tuple, type(None))
_SHOWN = 4
_REMEMBERED: WeakKeyDictionary[Any, dict[str, Any]] = WeakKeyDictionary()


def settings(trainer) -> dict[tuple[str, str], Any]:
    """(setting, where) -> value: each optimizer group's plain hyperparameters (``initial_lr`` as the learning rate
    where a scheduler set it, as ``lr`` then moves with the schedule) and each scheduler's plain settings."""
    values: dict[tuple[str, str], Any] = {}
    for i, optimizer in enumerate(trainer.optimizers):
        for j, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if key not in ("params", "initial_lr") and isinstance(value, _PLAIN):
                    name, value = ("learning rate", group.get("initial_lr", value)) if key == "lr" else (key, value)
                    values[name, f"optimizer {i} group {j}"] = value
    for i, config in enumerate(trainer.lr_scheduler_configs):
        for key, value in config.scheduler.state_dict().items():
            if key not in _PROGRESS and isinstance(value, _PLAIN):
                values[key, f"scheduler {i} ({type(config.scheduler).__name__})"] = value
    return values


def remember(trainer) -> None:
    """Read the configured values (once per trainer: a strategy and a callback may both ask)."""
    if trainer.optimizers and trainer not in _REMEMBERED:
        _REMEMBERED[trainer] = settings(trainer)


def report(trainer) -> str | None:
    """After a resume, warn once about every configured value the checkpoint replaced; return the warning."""
    before = _REMEMBERED.pop(trainer, None)
    if before is None or trainer.ckpt_path is None:
        return None
    after = settings(trainer)
    changed: dict[tuple[str, str, str], list[str]] = {}  # (setting, restored, configured) -> where
    for (name, where), value in before.items():
        if (name, where) in after and after[name, where] != value:
            changed.setdefault((name, repr(after[name, where]), repr(value)), []).append(where)
    if not changed:
        return None
    said = [f"{name} {won} (configured {lost}) in {', '.join(where)}" for (name, won, lost), where in changed.items()]
    more = f"; and {len(said) - _SHOWN} more" if len(said) > _SHOWN else ""
    message = (
        f"Resumed from {trainer.ckpt_path}: the checkpoint's optimizer and scheduler state won over the configured "
        f"values: {'; '.join(said[:_SHOWN])}{more}. Lightning restores that state on resume; to train with the new "
        "values, set them in the LightningModule's on_train_start (each param group's 'lr' and 'initial_lr', the "
        "scheduler's base_lrs), or start a new run from the weights alone."
    )
    rank_zero_warn(message)
    return message
