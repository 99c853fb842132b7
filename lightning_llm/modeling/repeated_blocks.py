"""Measuring a stack of identical blocks on two of them: the plan's cost stays flat in depth.

Planning measures each block's activations with one fake-tensor forward of the whole model. For a
deep model of identical blocks (same class, same parameter shapes, same settings) every block after
the first saves exactly what the second does, so a forward through the first two blocks gives all
of them: block 0 as measured, blocks 1..n-1 as block 1. The first is measured on its own because its
input comes from the embedding rather than from a block. The model's block list is swapped for a list
of its first two blocks for that one forward, then put back.

Blocks that differ in anything that could change what they save (a sliding-window flag, an extra
parameter, a hybrid's attention and Mamba blocks, DeepSeek-V3's dense and MoE blocks) are measured in full; so is any model whose forward does not run on a shortened list.
``tests/modeling/test_repeated_blocks.py`` checks the result against the full per-block measurement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lightning_llm._compat.torch import module_buffers, module_parameters

log = logging.getLogger(__name__)

# Attributes that number a block in its stack (Hugging Face's layer_idx, Megatron's layer_number): they
# differ between identical blocks and only name a KV-cache slot, which a training forward does not use.
_INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "block_index", "idx"})
_SIMPLE = (int, float, str, bool, type(None), torch.dtype, torch.device)
SAMPLED_BLOCKS = 2


def identical_blocks(blocks: Sequence[nn.Module]) -> bool:
    """Whether every block has the first block's module tree, parameter/buffer shapes and plain settings.

    Compared per submodule: class, parameters and buffers (name, shape, dtype, requires_grad), and plain
    attributes (numbers, strings, dtypes, tuples of them; tensors by shape and dtype; other objects by
    identity, so a config object shared by all blocks matches and per-block objects do not). Layer indices
    (``layer_idx`` and the like) are ignored.
    """
    first = _signature(blocks[0])
    return all(_signature(block) == first for block in blocks[1:])


def _signature(block: nn.Module) -> list:
    return [
        (name, type(m), _tensors(module_parameters(m)), _tensors(module_buffers(m)), _settings(m))
        for name, m in block.named_modules()
    ]


def _tensors(tensors: dict) -> tuple:
    return tuple((n, None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)) for n, t in tensors.items())


def _settings(module: nn.Module) -> tuple:
    return tuple(
        (k, _value(v)) for k, v in sorted(vars(module).items()) if not k.startswith("_") and k not in _INDEX_NAMES
    )


def _value(value):
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_value(v) for v in value)
    return ("object", id(value))


@contextmanager
def first_blocks(module: nn.Module, name: str, count: int):
    """Within the block, ``module``'s block list ``name`` (dotted) holds only its first ``count`` blocks."""
    parent_name, _, attr = name.rpartition(".")
    parent = module.get_submodule(parent_name)
    full = getattr(parent, attr)
    sample = list(full)[:count]  # a Sequential stays one: the forward calls it
    setattr(parent, attr, nn.Sequential(*sample) if isinstance(full, nn.Sequential) else nn.ModuleList(sample))
    try:
        yield
    finally:
        setattr(parent, attr, full)


def measure_repeated(module: nn.Module, name: str, blocks: Sequence[nn.Module], measure: Callable[[list], list]):
    """Per-block measurements of ``blocks`` from a forward through the first two, or ``None`` where that does not apply.

    ``measure(blocks)`` measures the given blocks during one forward of ``module`` and returns one result a
    block. Applies to more than two identical blocks; where the shortened forward fails or does not run
    both blocks, ``None`` tells the caller to measure the whole model.
    """
    if len(blocks) <= SAMPLED_BLOCKS or not identical_blocks(blocks):
        return None
    sample, calls = list(blocks[:SAMPLED_BLOCKS]), [0] * SAMPLED_BLOCKS
    hooks = [
        b.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)) for i, b in enumerate(sample)
    ]
    try:
        with first_blocks(module, name, SAMPLED_BLOCKS):
            first, second = measure(sample)
    except Exception as error:
        log.debug("measuring %d of %d blocks failed (%s); measuring all of them", SAMPLED_BLOCKS, len(blocks), error)
        return None
    finally:
        for hook in hooks:
            hook.remove()
    if calls != [1] * SAMPLED_BLOCKS:  # the forward does not loop once over the list it holds
        return None
    return [first] + [second] * (len(blocks) - 1)
