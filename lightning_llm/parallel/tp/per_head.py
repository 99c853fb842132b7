"""Lists of one module per head under tensor parallelism: each rank runs its own heads' entries.

Some attention modules keep a per-head parameter as a list of modules, one per head: StableLM 2's per-head q/k
LayerNorms (``q_layernorm.norms``, one ``LayerNorm(head_dim)`` per query head; ``k_layernorm.norms`` one per
key/value head) cut the heads one by one (``torch.split(x, 1, dim=1)``) and ``zip`` the pieces with the list. Once
the plan splits the heads, rank ``r`` holds heads ``lo..hi`` and must normalize them with entries ``lo..hi``.

The list gets the plan style ``per_head``. Its parameters stay whole on every rank, so checkpoints, FSDP and the
optimizer see the model's own layout (``norms.0`` .. ``norms.{H-1}``) and a consolidated checkpoint or a Hugging
Face export needs nothing special. For each call of the attention module, the list lends rank ``r`` only entries
``lo..hi`` (numbered from 0, as the model iterates them), and the gradients of all entries pass through one sum
over the tp group (each entry's gradient comes from the one rank that ran it, so every rank ends with the same,
whole gradient). The first-forward watch of :mod:`.split_outputs` checks that the heads cut into pieces are
computed independently and put back in order, which is what makes this split right.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_llm._compat.torch import module_parameters, swap_module_entries
from lightning_llm.modeling.attributes import int_attribute
from lightning_llm.parallel.tp.attention_variants import head_count, is_attention, model_config
from lightning_llm.parallel.tp.experts import sum_grad
from lightning_llm.parallel.tp.fused import KV_ATTRS, projection_dims

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
