"""Which blocks to checkpoint so the blocks' activations fit a byte budget: arithmetic on measured bytes.

Inputs are per-block byte counts (what each block saves without checkpointing, with full checkpointing
its input only, with the selective op policy its input plus the saved op outputs), measured by
:mod:`lightning_llm.modeling.activations`; nothing here touches a model.
"""

from __future__ import annotations

from collections.abc import Sequence


def validate_budget(budget) -> None:
    """Refuse a budget that is neither positive bytes (int) nor a fraction in (0, 1] (float)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"budget={budget!r} must be bytes (int) or a fraction of device memory (float in (0, 1]); 'auto' needs one."
        )
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"budget={budget} bytes must be positive.")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(
            f"budget={budget} as a float is a fraction of device memory and must lie in (0, 1]; pass bytes as an int "
            f"(e.g. budget={int(budget)})."
            if budget > 1
            else f"budget={budget} as a fraction must lie in (0, 1]."
        )


def resolve_budget(budget: int | float | None, device_memory: int | None) -> int:
    """Bytes from an absolute budget (int) or a fraction (float in (0, 1]) of ``device_memory``."""
    validate_budget(budget)
    if isinstance(budget, float):
        if device_memory is None:
            raise ValueError(f"budget={budget} is a fraction of device memory; pass device_memory (bytes) as well.")
        return int(budget * device_memory)
    return budget


def predicted_peak(saved: Sequence[int], kept: Sequence[int]) -> int:
    """Peak bytes of the blocks' activations when block ``i`` keeps ``kept[i]`` of the ``saved[i]`` it saves.

    Backward runs the blocks last to first; while block ``i`` runs, the blocks before it still hold
    what they kept and block ``i`` holds everything it saves (recomputed if checkpointed).
    """
    peak, before = 0, 0
    for s, k in zip(saved, kept):
        peak = max(peak, before + max(s, k))
        before += k
    return peak  # at least the end of the forward (``before``), as max(s, k) >= k


def plan_for_budget(
    saved: Sequence[int], inputs: Sequence[int], budget: int, op: Sequence[int | None] | None = None
) -> tuple[list[str], int]:
    """Per-block policies ("none", "op", "full") that keep :func:`predicted_peak` within ``budget``.

    Greedy, cheapest recomputation first: while over budget, give the selective op policy (it
    recomputes no matmul) to the block whose change lowers the excess over budget most; if every
    useful block has it and the peak is still too high, checkpoint blocks fully in the same order.
    A block whose change lowers nothing (the last block: it is recomputed while every other block
    still holds its activations) is left alone. Returns the policies and the predicted peak;
    refuses a budget below what full checkpointing of every block achieves, with the numbers.
    """
    floor = predicted_peak(saved, inputs)
    if budget < floor:
        raise ValueError(
            f"The activation budget {budget / 2**20:.1f} MiB is below what full checkpointing of every block keeps at "
            f"its peak ({floor / 2**20:.1f} MiB; without checkpointing {predicted_peak(saved, saved) / 2**20:.1f} MiB). "
            "Raise the budget, use a smaller micro-batch, or shard the sequence (sequence_parallel)."
        )
    kept_by = {"none": list(saved), "full": list(inputs)}
    levels = ["none", "full"]
    if op is not None and all(o is not None for o in op):
        kept_by["op"], levels = list(op), ["none", "op", "full"]
    policies, kept = ["none"] * len(saved), list(saved)
    for level in levels[1:]:
        while predicted_peak(saved, kept) > budget:
            index = _best_upgrade(saved, kept, policies, levels, level, kept_by[level], budget)
            if index is None:
                break
            policies[index], kept[index] = level, kept_by[level][index]
    return policies, predicted_peak(saved, kept)


def _excess(saved: Sequence[int], kept: Sequence[int], budget: int) -> int:
    """How far, summed over the backward of every block, the activations exceed ``budget``.

    (The end of the forward, the sum of what is kept, never exceeds the last block's backward.)
    """
    total, before = 0, 0
    for s, k in zip(saved, kept):
        total += max(0, before + max(s, k) - budget)
        before += k
    return total


def _best_upgrade(saved, kept, policies, levels, level, level_kept, budget) -> int | None:
    """The block whose move to ``level`` lowers the excess most (then frees most bytes); None if none helps."""
    now, best, best_gain = _excess(saved, kept, budget), None, (0, 0)
    for i, policy in enumerate(policies):
        if levels.index(policy) >= levels.index(level):
            continue
        trial = [*kept[:i], level_kept[i], *kept[i + 1 :]]
        gain = (now - _excess(saved, trial, budget), kept[i] - level_kept[i])
        if gain[0] > 0 and gain > best_gain:
            best, best_gain = i, gain
    return best
