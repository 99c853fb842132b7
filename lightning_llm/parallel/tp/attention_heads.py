"""What an attention module itself needs once the plan has split its heads: per-head parameters and module lists,
ALiBi, MQA widths.

The plan splits projections; four things live on the attention module and follow its heads whatever
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
  are per-rank values; head counts proper are divided by :mod:`.heads`;
- **lists of one module per head** (StableLM 2's per-head q/k LayerNorms, ``q_layernorm.norms``: one
  ``LayerNorm(head_dim)`` per query head, zipped with ``torch.split(x, 1, dim=1)``'s pieces) get the plan style
  ``per_head``. Their parameters stay whole on every rank, so checkpoints, FSDP, the optimizer and a Hugging Face
  export see the model's own layout (``norms.0`` .. ``norms.{H-1}``); for each call of the attention module the list
  lends rank ``r`` only its heads' entries ``lo..hi`` (numbered from 0, as the model iterates them), and the
  gradients of all entries pass through one sum over the tp group (each entry's gradient comes from the one rank that
  ran it). The first-forward watch of :mod:`.split_outputs` checks that the heads cut into pieces are computed
  independently and put back in order, which is what makes this split right.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_llm._compat.torch import module_parameters, swap_module_entries
from lightning_llm.parallel.lent_weights import lend_during_calls
from lightning_llm.parallel.tp.attention_variants import (
    alibi_argument,
    head_count,
    is_attention,
    model_config,
    per_head_parameters,
    recognise,
)
from lightning_llm.parallel.tp.experts import sum_grad
from lightning_llm.parallel.tp.fused import KV_ATTRS, projection_dims
from lightning_llm.parallel.tp.heads import int_attribute
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


STYLE = "per_head"


def _kv_count(attention: nn.Module, config: object | None) -> int | None:
    return int_attribute([attention, getattr(attention, "config", None) or config], KV_ATTRS)


def _is_per_head_list(module: nn.Module, counts: set[int]) -> bool:
    """A ModuleList of ``count`` entries of one class, each holding parameters and none a projection."""
    if not isinstance(module, nn.ModuleList) or len(module) not in counts:
        return False
    entries = list(module)
    return (
        len({type(e) for e in entries}) == 1
        and len({tuple(tuple(p.shape) for p in e.parameters()) for e in entries}) == 1
        and all(any(True for _ in e.parameters()) for e in entries)
        and all(projection_dims(m) is None for e in entries for m in e.modules())
    )


def per_head_lists(block: nn.Module, splits_heads) -> list[str]:
    """Names inside ``block`` of the per-head lists of its attention modules whose heads the plan splits.

    ``splits_heads(name)`` says whether the plan splits the heads of the attention module ``name`` (inside
    ``block``). A list counts as per head when its length is the module's query or key/value head count.

    Example::

        per_head_lists(stablelm.model.layers[0], lambda name: True)  # ["self_attn.q_layernorm.norms", ...]
    """
    config = model_config(block)
    found = []
    for name, module in block.named_modules():
        if not is_attention(module) or not splits_heads(name):
            continue
        counts = {c for c in (head_count(module, config), _kv_count(module, config)) if c and c > 1}
        prefix = f"{name}." if name else ""
        found += [prefix + rel for rel, m in module.named_modules() if rel and _is_per_head_list(m, counts)]
    return found


def lend_per_head_lists(attention: nn.Module, lists: list[str], mesh: DeviceMesh, where: str) -> None:
    """For each call of ``attention``, lend each list in ``lists`` (names inside it) this rank's entries only.

    Raises ValueError, before anything changes, when a list's length does not divide by the tp size.

    Example::

        lend_per_head_lists(layer.self_attn, ["q_layernorm.norms", "k_layernorm.norms"], tp_mesh, "model.layers.0")
    """
    tp, rank = mesh.size(), mesh.get_local_rank()
    for name in lists:
        length = len(attention.get_submodule(name))
        if length % tp:
            raise ValueError(
                f"{where}.{name} holds one module per head ({length} of them), not divisible by "
                f"tensor_parallel_size={tp}: each rank must hold whole heads. Use a tensor_parallel_size dividing "
                f"{length}, or keep the attention whole: tensor_parallel_replicate=['{where}']."
            )
    lent = [
        _Lent(attention.get_submodule(name), mesh, rank * len(attention.get_submodule(name)) // tp, tp)
        for name in lists
    ]
    if lent:
        attention.register_forward_pre_hook(lambda module, args: _each(lent, _Lent.lend))
        attention.register_forward_hook(lambda module, args, output: _each(lent, _Lent.give_back), always_call=True)


def _each(lent: list[_Lent], method) -> None:
    """Call ``method`` on every lent list; returns ``None``, so the hook leaves the call's arguments and output."""
    for entry in lent:
        method(entry)


class _Lent:
    """One per-head list: its entries ``lo .. lo + len/tp`` lent for a call, every entry's gradient summed over tp."""

    def __init__(self, entries: nn.ModuleList, mesh: DeviceMesh, lo: int, tp: int) -> None:
        self.entries, self.mesh = entries, mesh
        self.lo, self.hi = lo, lo + len(entries) // tp
        self.whole: OrderedDict | None = None
        self.slots: list[tuple[dict, str, torch.Tensor]] = []

    def lend(self) -> None:
        if self.whole is not None:  # re-entered (a recompute inside the same call): already lent
            return
        members = list(self.entries)
        for slot_name, *column in _parameter_slots(members):
            summed = sum_grad(torch.stack([slots[slot_name] for slots in column]), self.mesh)
            for index in range(self.lo, self.hi):
                self.slots.append((column[index], slot_name, column[index][slot_name]))
                column[index][slot_name] = summed[index]
        mine = OrderedDict((str(i), m) for i, m in enumerate(members[self.lo : self.hi]))
        self.whole = swap_module_entries(self.entries, mine)

    def give_back(self) -> None:
        if self.whole is None:
            return
        for slots, slot_name, original in self.slots:
            slots[slot_name] = original
        swap_module_entries(self.entries, self.whole)
        self.whole, self.slots = None, []


def _parameter_slots(members: list[nn.Module]) -> list[tuple]:
    """Per parameter position (module path and slot), the slot dictionaries of every member: ``(slot, d0, d1, ...)``.

    Read at call time: FSDP2 may have swapped in its unsharded parameters.
    """
    positions = []
    paths = [n for n, m in members[0].named_modules() if any(True for _ in m.parameters(recurse=False))]
    for path in paths:
        owners = [member.get_submodule(path) for member in members]
        for slot_name, value in module_parameters(owners[0]).items():
            if value is not None:
                positions.append((slot_name, *(module_parameters(owner) for owner in owners)))
    return positions
