"""Precision plugins that clip gradients by the true global norm of a parallelized model.

Lightning clips inside the precision plugin (``LightningModule.clip_gradients`` calls
``Precision.clip_grad_by_norm``), with ``torch.nn.utils.clip_grad_norm_``: that cannot mix the plain
and DTensor gradients of a tensor-parallel model (on up to two meshes) nor add the other pipeline
stages. Lightning's own FSDP strategy solves the same problem with a plugin of its own
(``FSDPPrecision``, chosen by the accelerator connector). ``LLMParallelStrategy`` does the same through
its public ``precision_plugin`` setter: the plugin the Trainer chose from ``precision=`` is exchanged
for the matching class below, which differs only in ``clip_grad_by_norm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llm._compat.torch import steps_with_amp_scaling
from lightning_llm.parallel.grad_scaler import distributed_in_place

ClipFn = Callable[[Optimizer, float], None]


class GlobalNormClipping:
    """Mixin for a Lightning precision plugin: ``clip_grad_by_norm`` clips by ``clip_fn`` (the global norm)."""

    clip_fn: ClipFn

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self.clip_fn(optimizer, float(clip_val))


class GlobalNormPrecision(GlobalNormClipping, Precision):
    """``precision="32-true"``."""


class GlobalNormMixedPrecision(GlobalNormClipping, MixedPrecision):
    """``precision="bf16-mixed"`` / ``"16-mixed"``.

    With fp16's loss scaler, a fused optimizer's gradients are unscaled right after backward like any other's, so
    monitors see true gradients and clipping works (Lightning leaves them scaled for the fused step to unscale, and
    refuses clipping). The scaler then tells the fused step they are unscaled already (torch's ``GradScaler.step``).
    """

    _unscaled: int | None = None  # id() of the fused optimizer unscaled in the step under way

    @override
    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None or not steps_with_amp_scaling(optimizer):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

        def closure_then_unscale() -> Any:
            result = closure()
            if result is not None or not model.automatic_optimization:  # None: backward skipped, nothing to unscale
                self.scaler.unscale_(optimizer)
                self._unscaled = id(optimizer)
            return result

        try:
            return super().optimizer_step(optimizer, model=model, closure=closure_then_unscale, **kwargs)
        finally:
            self._unscaled = None

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        algorithm = gradient_clip_algorithm or GradClipAlgorithmType.NORM
        if self._unscaled == id(optimizer):  # a fused optimizer's gradients, unscaled above: clip them as any
            return Precision.clip_gradients(self, optimizer, clip_val, algorithm)
        return super().clip_gradients(optimizer, clip_val, algorithm)  # Lightning's refusal where still scaled


class GlobalNormHalfPrecision(GlobalNormClipping, HalfPrecision):
    """``precision="bf16-true"`` / ``"16-true"``."""


def global_norm_precision(plugin: Precision | None, clip_fn: ClipFn) -> Precision | None:
    """The global-norm-clipping counterpart of Lightning's ``plugin`` (the same settings), or ``plugin`` itself.

    A plugin of another class (a user's own, bitsandbytes, transformer-engine) is returned unchanged;
    :func:`check_clipping` refuses norm clipping with it before training. The counterpart holds the plugin's own loss
    scaler, given the cross-rank unscale in place (:func:`~lightning_llm.parallel.grad_scaler.distributed_in_place`):
    the scaler the user passed is the one that scales.

    Example::

        plugin = global_norm_precision(MixedPrecision("bf16-mixed", "cuda"), strategy_clip_fn)
    """
    if plugin is None or isinstance(plugin, GlobalNormClipping):
        return plugin
    if type(plugin) is Precision:
        ours = GlobalNormPrecision()
    elif type(plugin) is MixedPrecision:
        # fp16's loss scaler unscales plain and DTensor gradients alike and skips a step on every rank together; it
        # stays the user's object (a callback reading the scaler they passed sees the run's scale).
        scaler = None if plugin.scaler is None else distributed_in_place(plugin.scaler)
        ours = GlobalNormMixedPrecision(plugin.precision, plugin.device, scaler)
    elif type(plugin) is HalfPrecision:
        ours = GlobalNormHalfPrecision(plugin.precision)
    else:
        return plugin
    ours.clip_fn = clip_fn
    return ours


def check_clipping(plugin: Precision, gradient_clip_val, gradient_clip_algorithm) -> None:
    """Refuse norm clipping through a precision plugin that would clip by a per-rank, per-stage norm."""
    if (
        gradient_clip_val
        and (gradient_clip_algorithm or "norm") == "norm"
        and not isinstance(plugin, GlobalNormClipping)
    ):
        raise ValueError(
            f"gradient_clip_val={gradient_clip_val} clips by norm, but the precision plugin {type(plugin).__name__} "
            "clips with torch.nn.utils.clip_grad_norm_, which sees only this rank's plain gradients. Use the Trainer's "
            "precision= flag (32-true, bf16-mixed, bf16-true, 16-true) instead of a custom plugin, or clip by value."
        )
