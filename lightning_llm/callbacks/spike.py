"""LossSpikeGuard: catch non-finite losses or gradients and loss spikes; warn, skip the step, or stop."""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_llm.callbacks import cadence
from lightning_llm.contract import contract_of
from lightning_llm.parallel.dtensor import local_tensor
from lightning_llm.validation import check_bool, check_choice, check_float, check_int

ACTIONS = ("warn", "skip", "stop")


class LossSpikeError(RuntimeError):
    """Raised by ``LossSpikeGuard(action="stop")``; the message names the step and batches."""


class LossSpikeGuard(L.Callback):
    """Watches every optimizer step for a non-finite loss or gradient, or a loss spike, and acts.

    A spike is a loss above ``mean + threshold * std`` of the last ``window`` good steps, checked
    once ``warmup_steps`` steps have been seen. The loss checked is the step's global mean (over
    accumulated micro-batches and data-parallel ranks), so every rank takes the same decision. This
    costs one small all-reduce and one host read per optimizer step. The statistics and counts are
    saved in Lightning checkpoints and restored on resume.

    Actions: ``"warn"``; ``"skip"``: the optimizer step is skipped on every rank and the gradients
    dropped, so parameters and optimizer state (moments, step counts) stay as they were (the LR
    schedule still advances; the gradients are set to ``None`` in ``on_before_optimizer_step``, so callbacks
    after this one and the module's own hook see none on a skipped step); ``"stop"``: raise :class:`LossSpikeError` naming the step and batches.
    Logged: ``loss_guard/nonfinite``, ``loss_guard/spikes`` and ``loss_guard/skipped`` (running counts).

    Arguments:
        action: "warn", "skip" or "stop".
        window: good steps the spike statistics cover.
        threshold: standard deviations above the mean that count as a spike.
        warmup_steps: steps before spikes are judged (non-finite values are judged from the start).
        check_gradients: also treat non-finite gradients as bad (under "16-mixed" precision the GradScaler
            handles overflowing gradients itself, so only the loss is checked).

    Example::

        trainer = L.Trainer(callbacks=[LossSpikeGuard(action="skip", threshold=6.0)])
    """

    def __init__(
        self,
        action: Literal["warn", "skip", "stop"] = "skip",
        window: int = 100,
        threshold: float = 6.0,
        warmup_steps: int = 20,
        check_gradients: bool = True,
    ) -> None:
        check_choice("action", action, ACTIONS)
        window = check_int("window", window, minimum=2, hint="a standard deviation needs at least 2 steps")
        threshold = check_float(
            "threshold", threshold, minimum=0, inclusive=False, hint="standard deviations above the mean, e.g. 6.0"
        )
        warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        check_bool("check_gradients", check_gradients)
        self.action, self.threshold, self.warmup_steps = action, threshold, warmup_steps
        self.check_gradients = check_gradients
        self.history: deque[float] = deque(maxlen=window)
        self.counts = {"nonfinite": 0, "spikes": 0, "skipped": 0}
        self._loss_sum: torch.Tensor | None = None
        self._batches: list[int] = []
        self._scaler_owns_overflow = False
        self._steps_seen = 0

    @override
    def state_dict(self) -> dict:
        # Saved with Lightning checkpoints, so a resumed run keeps its statistics and needs no new warmup.
        return {"history": list(self.history), "counts": dict(self.counts), "steps_seen": self._steps_seen}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.history.clear()
        self.history.extend(state_dict["history"])
        self.counts.update(state_dict["counts"])
        self._steps_seen = state_dict["steps_seen"]

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        if self.action == "skip":
            if not contract_of(trainer).can_skip_optimizer_step:  # DeepSpeed: the engine steps its own partitions
                raise ValueError(
                    "LossSpikeGuard(action='skip') cannot skip inside DeepSpeed's engine step; use 'warn' or 'stop' "
                    "with LLMDeepSpeedStrategy (DeepSpeed skips overflowing fp16 steps itself)."
                )
            for optimizer in trainer.optimizers:
                if isinstance(optimizer, torch.optim.LBFGS):
                    raise ValueError(
                        "LossSpikeGuard(action='skip') runs the closure once before deciding, but LBFGS re-evaluates "
                        "it inside its step; use action='warn' or 'stop' with LBFGS."
                    )
        # Under fp16 mixed precision the GradScaler owns overflowing gradients: it skips those steps and
        # lowers the scale, which is routine, not a fault.
        self._scaler_owns_overflow = str(trainer.precision) == "16-mixed"

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batches.append(batch_idx)

    @override
    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        # Lightning divides each micro-batch loss by accumulate_grad_batches: their sum is the step's mean.
        loss = loss.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        step, batches = trainer.global_step, self._batches
        loss, bad_grads = self._global_loss_and_grad_flag(trainer, pl_module)
        self._loss_sum, self._batches = None, []
        self._steps_seen += 1
        problem = None
        if not math.isfinite(loss) or bad_grads:
            self.counts["nonfinite"] += 1
            problem = f"non-finite {'loss' if not math.isfinite(loss) else 'gradients'} (loss {loss})"
        elif self._is_spike(loss):
            self.counts["spikes"] += 1
            mean, std = self._stats()
            problem = f"loss spike: {loss:.4f} > mean {mean:.4f} + {self.threshold} * std {std:.4f}"
        else:
            self.history.append(loss)
        if problem is not None:
            self._act(problem, step, batches, optimizer)
        if problem is not None or cadence.due(trainer, None, counted=False):
            for name, count in self.counts.items():
                pl_module.log(f"loss_guard/{name}", float(count), on_step=True, on_epoch=False)

    def _act(self, problem: str, step: int, batches: list[int], optimizer) -> None:
        report = f"LossSpikeGuard: {problem} at step {step} (batch indices {batches})"
        if self.action == "stop":
            raise LossSpikeError(report + "; stopping as configured (action='stop').")
        if self.action == "skip":
            # Torch optimizers leave a parameter without a gradient alone (no update, no moment or step
            # count change), so dropping every gradient makes the coming step a no-op on every rank.
            # Under "16-mixed" the GradScaler has already recorded its inf checks (Lightning unscales
            # before this hook), so its step runs the optimizer, which finds nothing to update.
            optimizer.zero_grad(set_to_none=True)
            self.counts["skipped"] += 1
            report += "; the optimizer step is skipped"
        rank_zero_warn(report)

    def _global_loss_and_grad_flag(self, trainer, pl_module) -> tuple[float, bool]:
        loss = self._loss_sum if self._loss_sum is not None else torch.tensor(float("nan"))
        flag = torch.zeros((), device=loss.device)
        if self.check_gradients and not self._scaler_owns_overflow:
            flag = (~_local_grads_finite(pl_module, loss.device)).float()
        stats = torch.stack([loss.reshape(()), flag])
        # Over every rank, not only the data-parallel replicas: pipeline and tensor peers carry the same loss, so
        # the mean is unchanged; the flag's mean is positive exactly when some rank saw a non-finite gradient.
        stats = contract_of(trainer).reduce_across_ranks(stats, "mean")
        loss_value, flag_value = stats.tolist()
        return loss_value, flag_value > 0

    def _stats(self) -> tuple[float, float]:
        values = torch.tensor(list(self.history), dtype=torch.float64)
        return values.mean().item(), values.std().item()

    def _is_spike(self, loss: float) -> bool:
        if self._steps_seen <= self.warmup_steps or len(self.history) < 2:
            return False
        mean, std = self._stats()
        return loss > mean + self.threshold * max(std, 1e-8)


def _local_grads_finite(module, device: torch.device) -> torch.Tensor:
    grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(True, device=device)
    # One fused pass: the total norm is finite exactly when every gradient is.
    return torch.nn.utils.get_total_norm(grads).isfinite().to(device)
