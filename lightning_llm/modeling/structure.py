"""A model's structure read from its forward: which modules it calls, in what order, and which of them are the blocks.

The blocks are the repeated computation the forward runs: consecutive calls, made from one module's forward, into
the entries of one container (an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``: torchtitan and OLMo-core
key their blocks "0", "1", ...), or into same-class attributes of the caller. An entry need not have a forward of its
own: x-transformers keeps each layer as a list of ``[norms, mixer, residual]`` slots and calls the slots from the
stack's forward; the calls land in the entry all the same. When several such runs exist (an MoE block's experts
inside the blocks), the one holding the most parameters is the blocks.

The forward runs once on fake parameters (nothing is allocated; a model on the meta device works) with the user's
own input, through the caller's function (a ``training_step``), with module-level forward hooks
(``torch.nn.modules.module.register_module_forward_pre_hook``) recording each call and the call it is made from,
and a ``TorchFunctionMode`` recording which calls run attention (context parallelism routes those blocks' attention
and runs the other sequence mixers on the gathered sequence) and which linears' outputs the forward cuts into parts
(:mod:`~lightning_llm.modeling.output_cuts`: tensor parallelism splits those per part).

Example::

    calls = trace_calls(model, lambda: model(tokens))
    blocks = blocks_from_calls(model, calls)   # TracedBlocks(container="layers", names=["layers.0", ...])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from lightning_llm.modeling.output_cuts import OutputCuts, Part

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class Call:
    """One module call: the module's name in the traced root, the index of the call it was made from, and whether
    attention (``scaled_dot_product_attention`` or ``multi_head_attention_forward``) ran in it, outside its callees;
    for a linear, the widths the forward cut its output into along the last dimension (empty when it did not)."""

    name: str
    caller: int | None
    attends: bool = False
    cut: tuple[Part, ...] = ()


@dataclass
class TracedBlocks:
    """The blocks a forward ran: their container's name (``""`` for attributes of the caller) and their names."""

    container: str
    names: list[str]
    caller: str = ""
    calls: dict[str, list[str]] = field(default_factory=dict)  # block -> the modules called in it, outermost
    called: set[str] = field(default_factory=set)  # every module the forward called
    attends: set[str] = field(default_factory=set)  # the modules attention ran in (not counting their callees)
    before: set[str] = field(default_factory=set)  # modules called before the first block and never after it
    cuts: dict[str, tuple[Part, ...]] = field(default_factory=dict)  # linear -> the parts its output was cut into
    order: list[str] = field(default_factory=list)  # every module called, in the order of its first call

    def whole_container(self, root: nn.Module) -> bool:
        """Whether the blocks are every entry of their container, in the container's order."""
        if not self.container or not _holds_layers(root.get_submodule(self.container)):
            return False  # blocks held as attributes of their caller
        container = root.get_submodule(self.container)
        return [f"{self.container}.{key}" for key, _ in container.named_children()] == self.names

    def override(self, root: nn.Module) -> str | list[str]:
        """What ``find_blocks(root, override)`` takes to give these blocks: the container's name, else their names."""
        return self.container if self.whole_container(root) else list(self.names)

    def bypassed(self) -> dict[str, list[str]]:
        """Block -> the modules called in it, for the blocks whose own forward the model did not call (a list of
        slots, or a forward bypassed for another method): data parallelism and checkpointing hook those instead."""
        return {name: calls for name, calls in self.calls.items() if name not in calls}


def trace_calls(root: nn.Module, run: Callable[[], Any]) -> list[Call]:
    """The calls of ``root``'s submodules made while ``run()`` runs, in order (``root`` itself included as ``""``).

    A module reachable under several names is recorded under the first (``named_modules``'s).
    """
    names = {id(m): n for n, m in root.named_modules()}
    calls: list[Call] = []
    stack: list[int] = []

    def enter(module: nn.Module, args: tuple) -> None:
        name = names.get(id(module))
        if name is not None:
            calls.append(Call(name, stack[-1] if stack else None))
            stack.append(len(calls) - 1)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if names.get(id(module)) is not None and stack:
            index = stack.pop()
            if isinstance(module, nn.Linear):
                cuts.watch(index, output)

    attending: set[int] = set()
    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True)]
    try:
        with AttentionCalls(lambda: attending.add(stack[-1]) if stack else None), OutputCuts() as cuts:
            run()
    finally:
        for handle in handles:
            handle.remove()
    return [Call(c.name, c.caller, i in attending, cuts.parts(i)) for i, c in enumerate(calls)]


class AttentionCalls(TorchFunctionMode):
    """Calls ``seen()`` for each attention call (what context parallelism routes; an eager softmax is not seen).

    Example::

        with AttentionCalls(lambda: print("attention")):
            model(input_ids)
    """

    def __init__(self, seen: Callable[[], None]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention or func is F.multi_head_attention_forward:
            self.seen()
        return func(*args, **(kwargs or {}))


def _entry(root: nn.Module, caller: str, name: str) -> tuple[str, str]:
    """(container, unit) of a call to ``name`` made from ``caller``: the unit is the first module on the path below
    the caller whose parent is a container of layers; without one, the caller's child on the path (an attribute).
    A container holding an embedding holds a whole model (litgpt's ``transformer`` ModuleDict), not layers."""
    parts = name.split(".") if name else []
    start = len(caller.split(".")) if caller else 0
    for end in range(start + 1, len(parts) + 1):
        parent = ".".join(parts[: end - 1])
        if _holds_layers(root.get_submodule(parent)):
            return parent, ".".join(parts[:end])
    return caller, ".".join(parts[: start + 1])


def _holds_layers(module: nn.Module) -> bool:
    return isinstance(module, CONTAINERS) and not any(isinstance(c, nn.Embedding) for c in module.children())


def _runs(root: nn.Module, calls: list[Call], caller: int | None) -> list[TracedBlocks]:
    """Runs of distinct consecutive units of one container among the calls made from call ``caller``."""
    caller_name = calls[caller].name if caller is not None else ""
    units: list[tuple[str, str, str]] = []  # (container, unit, called module)
    for call in calls:
        if call.caller == caller and call.name != caller_name:
            units.append((*_entry(root, caller_name, call.name), call.name))
    runs, current = [], None
    for container, unit, called in units:
        if current is not None and current.container == container and current.names[-1] == unit:
            current.calls[unit].append(called)  # another slot of the same entry (x-transformers' layers)
            continue
        same = current is not None and current.container == container and unit not in current.names
        attribute = not _holds_layers(root.get_submodule(container))  # blocks held as attributes: of one class
        if same and (not attribute or _same_class(root, current.names[-1], unit)):
            current.names.append(unit)
            current.calls[unit] = [called]
            continue
        current = TracedBlocks(container, [unit], caller_name, {unit: [called]})
        runs.append(current)
    return [run for run in runs if len(run.names) > 1]


def _same_class(root: nn.Module, a: str, b: str) -> bool:
    """Blocks held as attributes: two modules of one class, each made of layers (not two embeddings or Linears)."""
    first, second = root.get_submodule(a), root.get_submodule(b)
    composite = all(any(True for _ in m.children()) for m in (first, second))
    return composite and type(first) is type(second)


def _numel(root: nn.Module, names: list[str]) -> int:
    return sum(p.numel() for n in names for p in root.get_submodule(n).parameters())


def blocks_from_calls(root: nn.Module, calls: list[Call]) -> TracedBlocks | None:
    """The blocks among ``calls`` (see the module docstring), or ``None`` when the forward repeats nothing."""
    callers = {None, *(c.caller for c in calls)}
    candidates = [run for caller in callers for run in _runs(root, calls, caller)]
    if not candidates:
        return None
    blocks = max(candidates, key=lambda run: (_numel(root, run.names), len(run.names)))
    blocks.called = {c.name for c in calls}
    blocks.attends = {c.name for c in calls if c.attends}
    blocks.cuts = _agreed_cuts(calls)
    blocks.order = list(dict.fromkeys(c.name for c in calls))
    inside = tuple(f"{name}." for name in blocks.names)  # a block's own forward may be bypassed: its callees count
    first = next(i for i, c in enumerate(calls) if c.name in blocks.names or c.name.startswith(inside))
    blocks.before = {c.name for c in calls[:first]} - {c.name for c in calls[first:]}
    return blocks


def _agreed_cuts(calls: list[Call]) -> dict[str, tuple[Part, ...]]:
    """Module -> the cut of its output, for the modules every call of which was cut the same way."""
    seen: dict[str, set[tuple[Part, ...]]] = {}
    for call in calls:
        seen.setdefault(call.name, set()).add(call.cut)
    return {name: next(iter(cuts)) for name, cuts in seen.items() if len(cuts) == 1 and () not in cuts}


def traced_blocks(root: nn.Module, run: Callable[[Callable[[Any], Any]], Any]) -> TracedBlocks | None:
    """:func:`blocks_from_calls` of one run of ``run(move)``, where ``move(batch)`` puts the inputs where the run's
    parameters are: the meta device first (nothing allocated; what a forward caches stays apart from the real run's,
    see :func:`~lightning_llm.modeling.fake.meta_parameters`), then fake tensors (some kernels have no meta
    version), then, for a model with real parameters, one real forward without autograd (some kernels have no
    fake version either: torch's grouped_mm in fp32). A forward that needs values on meta and fake tensors
    (``.item()``, a branch on a tensor) is traced by the real forward, or raises on the meta device.

    Example::

        blocks = traced_blocks(module, lambda move: module.training_step(move(batch), 0))
    """
    from lightning_llm.modeling.fake import fake_parameters, meta_parameters

    on_meta = any(p.is_meta for p in root.parameters())
    device = next((p.device for p in root.parameters() if not p.is_meta), torch.device("cpu"))
    attempts = [
        lambda: meta_parameters(root, lambda: run(_to(torch.device("meta")))),
        lambda: fake_parameters(root, lambda: run(_to(device)), device=device),
    ]
    if not on_meta:
        attempts.append(lambda: run(_to(device)))
    with torch.no_grad():
        for attempt in attempts:
            try:
                calls = trace_calls(root, attempt)
                break
            except Exception:
                if attempt is attempts[-1]:
                    raise
    return blocks_from_calls(root, calls)


def _to(device: torch.device) -> Callable[[Any], Any]:
    return lambda data: move_data_to_device(data, device)


def sequence_mixers(block: nn.Module) -> list[nn.Module]:
    """The children of ``block`` holding an ``nn.Conv1d`` wider than one step: the short convolution every Mamba,
    Mamba-2, gated delta-net and short-convolution mixer runs over the sequence.

    Example::

        sequence_mixers(falcon_h1.model.layers[0])   # [FalconH1Mixer]
    """
    return [child for child in block.children() if any(map(is_sequence_conv, child.modules()))]


def is_sequence_conv(module: nn.Module) -> bool:
    """An ``nn.Conv1d`` wider than one step (a convolution over the sequence, not a pointwise projection)."""
    return isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1
