"""Every rank's random generators in a checkpoint, so a resumed run draws the numbers the straight run would."""

from __future__ import annotations

from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """This process's random generators (Python, NumPy, torch CPU and current accelerator).

    Lightning's Trainer does not checkpoint them; dropout or sampling in a resumed run would then
    draw other numbers than the uninterrupted run. (Fabric's ``_collect_rng_states`` is private.)
    """
    import random

    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    # Tensors and plain values only, so checkpoints stay loadable with torch.load(weights_only=True).
    numpy = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    import random

    import numpy as np

    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`rng_state`, indexed by global rank (a collective: call it on every rank)."""
    import torch.distributed as dist

    state = rng_state()
    if not (dist.is_available() and dist.is_initialized()):
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states
