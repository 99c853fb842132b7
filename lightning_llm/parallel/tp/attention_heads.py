"""What an attention module itself needs once the plan has split its heads: per-head parameters, ALiBi, MQA widths.

The plan splits projections; three things live on the attention module and follow its heads whatever
plan split them (inferred, Hugging Face's or the user's):

- **per-head parameters** (HF GptOss ``self_attn.sinks``, per-head scales: dim 0 = the head count) become
  ``Shard(0)`` DTensors on the tp mesh, contiguous heads per rank like the projections, so checkpoints,
  the optimizer and FSDP see ordinary shards. The attention code indexes them beside plain local
  activations, so the module is lent its local shard for each call
  (:mod:`lightning_llm.parallel.lent_weights`);
- **ALiBi**: the model builds one bias slice per head (HF Bloom's ``alibi``: batch x heads rows, MPT's
  ``position_bias``: heads rows) and passes it to every attention module; a forward pre-hook
  (``with_kwargs=True``) hands the module this rank's heads' rows only, so each rank applies its own
  heads' slopes;
- **multi-query widths**: with one k/v head shared by all ranks, the group size
  (``num_key_value_groups``) and the query width some modules split with (GPTBigCode's ``embed_dim``)
  are per-rank values; head counts proper are divided by :mod:`.heads`.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_llm.parallel.lent_weights import lend_during_calls
from lightning_llm.parallel.tp.attention_variants import (
    alibi_argument,
    head_count,
    is_attention,
    per_head_parameters,
    recognise,
)
from lightning_llm.parallel.tp.per_head import lend_per_head_lists
from lightning_llm.parallel.tp.style_kinds import opens

MQA_WIDTH_ATTRS = ("embed_dim", "split_size", "hidden_size")


def splits_heads(name: str, styles: dict[str, str]) -> bool:
    """Whether ``styles`` (module names inside a block -> style) split a projection under the module ``name``."""
    prefix = f"{name}." if name else ""
    return any(n.startswith(prefix) and opens(s) for n, s in styles.items())


def shard_attention_heads(
    block: nn.Module, styles: dict[str, str], mesh: DeviceMesh, config=None, seen: set[int] | None = None
) -> list[str]:
    """Split the per-head state of every attention module in ``block`` whose projections ``styles`` split.

    ``styles`` maps module names inside ``block`` to plan styles; an attention module named there itself
    is left to its style. Call before head counts are divided (the global count is read here). ``seen``
    holds the ids of attention modules already split (one called from several blocks is split once); this
    call adds to it. Returns what was done, one line per module.
    """
    done = []
    seen = set() if seen is None else seen
    for name, module in block.named_modules():
        if not is_attention(module) or name in styles or not splits_heads(name, styles) or id(module) in seen:
            continue
        seen.add(id(module))
        heads = head_count(module, config)
        tp, rank = mesh.size(), mesh.get_local_rank()
        lo, hi = rank * heads // tp, (rank + 1) * heads // tp
        sharded = _shard_per_head(module, heads, mesh)
        prefix = f"{name}." if name else ""
        lists = [n[len(prefix) :] for n, s in styles.items() if s == "per_head" and n.startswith(prefix)]
        lend_per_head_lists(module, lists, mesh, f"block.{name}" if name else "block")
        argument = alibi_argument(module)
        if argument:
            _slice_alibi(module, argument, heads, lo, hi)
        variant = recognise(module, config)
        widths = _localize_mqa(module, heads, tp) if variant and variant.kind == "mqa" else []
        if sharded or argument or widths or lists:
            done.append(f"{name}: per-head {sharded + lists}, alibi {argument!r}, local widths {widths}")
    return done


def _shard_per_head(module: nn.Module, heads: int, mesh: DeviceMesh) -> list[str]:
    names = per_head_parameters(module, heads)
    for name in names:
        param = getattr(module, name)
        module.register_parameter(
            name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        )
    if names:
        lend_during_calls(module, names)
    return names


def _slice_alibi(module: nn.Module, argument: str, heads: int, lo: int, hi: int) -> None:
    position = list(inspect.signature(module.forward).parameters).index(argument)

    def hook(m, args, kwargs):
        if argument in kwargs:
            kwargs[argument] = _rows(kwargs[argument], heads, lo, hi, argument)
        elif len(args) > position:
            args = (*args[:position], _rows(args[position], heads, lo, hi, argument), *args[position + 1 :])
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _rows(bias, heads: int, lo: int, hi: int, argument: str):
    """Rows ``lo:hi`` of each group of ``heads`` rows along dim 0 (``(batch * heads, ...)`` or ``(heads, ...)``)."""
    if not isinstance(bias, torch.Tensor):
        return bias
    if bias.shape[0] % heads:
        raise ValueError(
            f"ALiBi argument {argument!r} has {bias.shape[0]} rows, not a multiple of the {heads} heads; cannot tell "
            "which rows belong to this rank's heads. Give the attention module a plan entry that keeps it whole."
        )
    rest = bias.shape[1:]
    return bias.reshape(-1, heads, *rest)[:, lo:hi].reshape(-1, *rest)


def _localize_mqa(module: nn.Module, heads: int, tp: int) -> list[str]:
    """Per-rank group size and query widths of a multi-query module (its one k/v head stays whole)."""
    changed = []
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(groups, int) and groups == heads:
        module.num_key_value_groups = groups // tp
        changed.append("num_key_value_groups")
    dim = getattr(module, "head_dim", None)
    for attr in MQA_WIDTH_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(dim, int) and isinstance(value, int) and value == heads * dim:
            setattr(module, attr, value // tp)
            changed.append(attr)
    return changed
