"""Strict checkpoint loading: the checkpoint's tensors and the model's must match both ways, names and shapes.

torch's ``load_state_dict(strict=True)`` compares the state dict it is given; a sharded loader builds
that dict from the model, so tensors that only the checkpoint has are never seen. Here the key sets
of both sides are compared before anything is loaded. ``LightningModule.strict_loading = False`` is
the opt-out: only the tensors present on both sides with equal shapes are loaded, with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

Shapes = Mapping[str, tuple[int, ...] | None]  # name -> shape (None: not a tensor, shape not compared)
_SHOWN = 5


def few(names: list[str]) -> str:
    """How many ``names``, and the first few: ``"7 (a, b, c, d, e, ... and 2 more)"``."""
    shown = ", ".join(names[:_SHOWN])
    return f"{len(names)} ({shown}{f', ... and {len(names) - _SHOWN} more' if len(names) > _SHOWN else ''})"


def mismatch(model: Shapes, checkpoint: Shapes) -> list[str]:
    """What differs between the model's and the checkpoint's tensors, one phrase per kind (empty if nothing)."""
    missing = sorted(set(model) - set(checkpoint))
    unexpected = sorted(set(checkpoint) - set(model))
    shapes = sorted(
        f"{name} {tuple(checkpoint[name])} in the checkpoint vs {tuple(model[name])} in the model"
        for name in set(model) & set(checkpoint)
        if model[name] is not None and checkpoint[name] is not None and tuple(model[name]) != tuple(checkpoint[name])
    )
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {few(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {few(unexpected)}")
    if shapes:
        problems.append(f"shapes differ: {few(shapes)}")
    return problems


def matching_keys(model: Shapes, checkpoint: Shapes, strict: bool, source: str) -> set[str]:
    """The names to load from ``checkpoint`` into the model; raise if ``strict`` and anything differs.

    Example::

        keys = matching_keys({"w": (4, 4)}, {"w": (4, 4), "v": (2,)}, strict=False, source="ckpt/step=10.ckpt")
    """
    problems = mismatch(model, checkpoint)
    if problems and strict:
        raise RuntimeError(
            f"Checkpoint {source} does not fit the model: {'; '.join(problems)}. Load a checkpoint saved from this "
            "model's architecture, or set `strict_loading = False` on the LightningModule to load only the "
            "tensors both have with equal shapes (the rest keep their initial values)."
        )
    if problems:
        rank_zero_warn(
            f"strict_loading=False: checkpoint {source} differs from the model ({'; '.join(problems)}); "
            "only the tensors both have with equal shapes are loaded."
        )
    return {
        name
        for name in set(model) & set(checkpoint)
        if model[name] is None or checkpoint[name] is None or tuple(model[name]) == tuple(checkpoint[name])
    }
