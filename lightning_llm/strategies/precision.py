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

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llm.parallel.grad_scaler import DistributedGradScaler

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
    """``precision="bf16-mixed"`` / ``"16-mixed"``."""


class GlobalNormHalfPrecision(GlobalNormClipping, HalfPrecision):
    """``precision="bf16-true"`` / ``"16-true"``."""


def global_norm_precision(plugin: Precision | None, clip_fn: ClipFn) -> Precision | None:
    """The global-norm-clipping counterpart of Lightning's ``plugin`` (the same settings), or ``plugin`` itself.

    A plugin of another class (a user's own, bitsandbytes, transformer-engine) is returned unchanged;
    :func:`check_clipping` refuses norm clipping with it before training.

    Example::

        plugin = global_norm_precision(MixedPrecision("bf16-mixed", "cuda"), strategy_clip_fn)
    """
    if plugin is None or isinstance(plugin, GlobalNormClipping):
        return plugin
    if type(plugin) is Precision:
        ours = GlobalNormPrecision()
    elif type(plugin) is MixedPrecision:
        # fp16's loss scaler unscales plain and DTensor gradients alike and skips a step on every rank together.
        scaler = None if plugin.scaler is None else DistributedGradScaler.like(plugin.scaler, plugin.device)
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
