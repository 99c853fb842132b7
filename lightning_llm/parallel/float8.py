"""FP8 training through torchao's float8 ``Float8Linear`` (dynamic scaling, tensorwise or rowwise).

Only the matmuls inside the transformer blocks move to fp8. Skipped, as torchtitan does:

* every ``nn.Linear`` outside the blocks: the output head (``lm_head``/``output``) feeds the loss
  directly and is the layer most sensitive to fp8 rounding;
* layers whose ``in_features`` or ``out_features`` is not a multiple of 16 (``torch._scaled_mm``
  needs 16-aligned dims; torchao would fail at the first forward instead);
* names matching a user's ``exclude`` patterns (fnmatch over ``named_modules()`` of the model).

The swap happens before FSDP2 wraps the model. With ZeRO 2/3 sharding and tensorwise scaling,
FSDP2 all-gathers the weights already cast to fp8 (torchao's ``enable_fsdp_float8_all_gather``),
half the bytes of a bf16 all-gather; :func:`precompute_fp8_scales` then computes every weight's
scale with one all-reduce after the optimizer step instead of one per layer in the forward.
"""

from __future__ import annotations

import fnmatch
import logging
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

FP8_RECIPES = ("tensorwise", "rowwise")
_ALIGNMENT = 16


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise RuntimeError(
            "fp8 training (fp8=...) needs torchao's float8 package, which is not importable here "
            f"({err}). Install the extra: pip install 'lightning_llm[fp8]'."
        ) from err
    return float8


def validate_fp8(fp8: bool | str) -> str | None:
    """The recipe name for the strategy's ``fp8`` argument (``True`` = "tensorwise"), or None when off."""
    if fp8 is False or fp8 is None:
        return None
    recipe = "tensorwise" if fp8 is True else fp8
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8={fp8!r} is not supported; use True, False or one of {FP8_RECIPES}.")
    _torchao_float8()  # refused at construction, not at the first step, when torchao is missing
    return recipe


def check_fp8_device(recipe: str | None, device: torch.device) -> str | None:
    """``recipe``, after checking ``device`` can run fp8 matmuls: CPU can (slowly); CUDA needs sm_89 or newer."""
    if recipe is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError(
            f"fp8={recipe!r} needs fp8 tensor cores (compute capability >= 8.9, e.g. H100, L40S), but "
            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}; set fp8=False."
        )
    return recipe


def fp8_filter(blocks_name: str, exclude: Sequence[str] = ()) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: True for the Linear layers that train in fp8 (see the module docstring)."""

    def convert(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or not name.startswith(blocks_name + "."):
            return False
        if module.in_features % _ALIGNMENT or module.out_features % _ALIGNMENT:
            return False
        return not any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)

    return convert


def apply_fp8(
    module: nn.Module,
    *,
    blocks_name: str,
    recipe: str = "tensorwise",
    exclude: Sequence[str] = (),
    fsdp_float8_all_gather: bool = False,
    emulate: bool = False,
) -> list[str]:
    """Swap the eligible Linear layers of ``module`` for torchao's ``Float8Linear`` in place; return their names.

    ``fsdp_float8_all_gather`` (tensorwise only) lets FSDP2 all-gather fp8 weights; ``emulate``
    computes the fp8 matmuls in high precision (torchao's test mode, for devices without fp8).

    Example::

        converted = apply_fp8(lightning_module, blocks_name="model.layers", exclude=["*.w2"])
    """
    float8 = _torchao_float8()
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    else:
        if fsdp_float8_all_gather:
            raise ValueError(
                f"fp8 recipe {recipe!r} cannot all-gather fp8 weights under FSDP2 (torchao supports that for "
                "'tensorwise' only); use fp8='tensorwise' or set fsdp_float8_all_gather=False."
            )
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        if emulate:
            from dataclasses import replace

            config = replace(config, emulate=True)
    keep = fp8_filter(blocks_name, exclude)
    names = [name for name, m in module.named_modules() if keep(m, name)]
    unmatched = [p for p in exclude if not any(fnmatch.fnmatchcase(n, p) for n, _ in module.named_modules())]
    if unmatched:  # a pattern that excludes nothing is most likely a typo: the layers it meant run in fp8
        warnings.warn(
            f"fp8_exclude patterns {unmatched} match no module (names look like "
            f"{[n for n, _ in module.named_modules() if n][:4]}); the layers they were meant to keep out run in fp8.",
            stacklevel=2,
        )
    if not names:
        raise ValueError(
            f"fp8 found no Linear layer to convert under {blocks_name!r} (in/out features must be multiples of "
            f"{_ALIGNMENT}; exclude={list(exclude)}); train without fp8 or change the exclusions."
        )
    float8.convert_to_float8_training(module, module_filter_fn=keep, config=config)
    log.info("Applied fp8 (%s scaling) to %d Linear layers under %s", recipe, len(names), blocks_name)
    return names


def precompute_fp8_scales(module: nn.Module) -> None:
    """After the optimizer step: every fp8-all-gathered weight's scale in one all-reduce (torchao's helper)."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(module)
