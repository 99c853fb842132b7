"""The layout of a fused projection inference cannot name, read off what the model does with its output.

A layer whose name says "fused" (``qkv``, ``Wqkv``, ``query_key_value``) but whose owner is not in
:data:`.infer.KNOWN_FUSED` may store ``[q | k | v]`` (MPT, DBRX), heads one after another with each head's q, k
and v together (Persimmon, MiniMax, Bloom), or parts of unequal widths. Names and widths cannot tell these
apart; the model's own forward can. One forward of the model on fake tensors (nothing computed or allocated,
a model on the meta device included) follows each such layer's output through element-wise ops (a clamp, an
activation) to the op that consumes it:

* ``split``/``chunk`` along the last dimension into parts whose widths divide by tp: the parts are stored one
  after another, each split per head: ``fused_colwise:A,B,...`` (each rank gets its share of every part);
* a ``view``/``reshape`` of the last dimension into (heads, ...) with a head count of the model's config that
  tp divides: heads are stored one after another: ``colwise`` (each rank gets whole heads, every part of them).

Anything else (a slice, a matmul, a forward that cannot run on fake tensors) leaves the layer unknown, and
:mod:`.coverage` refuses it with the entry that splits it, as before.

The same forward classifies the layers names and shapes cannot (a square ``w_q`` or ``w_out``, as OLMo-core and
torchtitan name them), from the chain their tensors take through the attention:

* the output viewed into (heads, head_dim): an input projection, ``colwise``;
* the input a merge of heads (a ``(..., heads, head_dim)`` tensor reshaped to ``(..., heads * head_dim)``), directly
  or through element-wise ops: an output projection, ``rowwise``;
* the output multiplied element-wise with a merge of heads (a gate on the attention's output, RetNet's ``g_proj``):
  split like the heads it gates, ``colwise``.

The same forward settles the layers shapes and names disagree on (:attr:`.infer.Inferred.contested`): one
named like an input projection that writes the block's width from another width reads as row-wise by shape.
Zamba2's ``q_proj`` reads the residual and the embeddings side by side (twice the width) and writes one width
of heads: when the forward views its output into heads it is split column-wise; otherwise shape decides.

The forward stops as soon as every watched layer is decided, before the routed experts' data-dependent ops most
MoE models run later.
"""

from __future__ import annotations

import inspect
import logging
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_llm.modeling.blocks import block_modules
from lightning_llm.modeling.fake import fake_parameters
from lightning_llm.modeling.log_redirect import redirected_log
from lightning_llm.modeling.output_cuts import CUTS, VIEWS, Part, cut_sizes
from lightning_llm.parallel.tp.heads import HEAD_ATTRS, attribute
from lightning_llm.parallel.tp.infer import FUSED_NAME, pattern_of

log = logging.getLogger(__name__)

_TOKENS = 8  # a fake batch of one sequence this long


class _Decided(Exception):
    """Every watched layer has its layout: the rest of the forward is not needed."""


class _Follow(TorchFunctionMode):
    """Follows each watched output to the op that consumes it and records the layout that op implies."""

    def __init__(self, names: list[str], heads: set[int], tp: int) -> None:
        super().__init__()
        self.pending, self.heads, self.tp = set(names), heads, tp
        self.tracked: dict[int, tuple[weakref.ref, str]] = {}
        self.merged: dict[int, weakref.ref] = {}  # tensors that are heads merged back into one width
        self.found: dict[str, str] = {}

    def watch(self, name: str, output) -> None:
        if name in self.pending and isinstance(output, torch.Tensor):
            self.tracked[id(output)] = (weakref.ref(output), name)

    def watch_input(self, name: str, args: tuple) -> None:
        """A watched layer reading a merge of heads is the output projection closing them."""
        if name in self.pending and args and self._is_merged(args[0]):
            self._decide(name, "rowwise")

    def _watched_name(self, value) -> str | None:
        ref, name = self.tracked.get(id(value), (None, None))
        return name if ref is not None and ref() is value else None

    def _is_merged(self, value) -> bool:
        ref = self.merged.get(id(value))
        return ref is not None and ref() is value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        result = func(*args, **kwargs)
        self._note_merge(func, args, x, result)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        watched = [(a, name) for a in tensors if (name := self._watched_name(a)) in self.pending]
        if not watched:
            return result
        x, name = watched[0]
        if isinstance(result, torch.Tensor) and result.shape == x.shape and func not in VIEWS:
            if any(self._is_merged(a) for a in tensors):  # gating the heads' merged output: split like them
                self._decide(name, "colwise")
            else:
                self.tracked[id(result)] = (weakref.ref(result), name)  # element-wise: follow the output on
            return result
        if getattr(func, "__name__", "") == "__get__":  # .shape, .dtype: not a use of the values
            return result
        self._decide(name, _layout(func, args, kwargs, x, result, self.heads, self.tp))
        return result

    def _note_merge(self, func, args, x, result) -> None:
        """Record ``result`` as a merge of heads: a reshape of ``(..., heads, head_dim)`` into one width, or an
        element-wise op (or copy) of such a merge."""
        if not isinstance(result, torch.Tensor) or not isinstance(x, torch.Tensor) or not result.dim():
            return
        heads = self.heads | {h // self.tp for h in self.heads}
        if self._is_merged(x):  # a copy, an element-wise op or a view keeping the merged width
            if result.shape == x.shape or (func in VIEWS and result.shape[-1] == x.shape[-1]):
                self.merged[id(result)] = weakref.ref(result)
        elif func in VIEWS and x.dim() >= 3 and result.dim() < x.dim() and x.shape[-2] in heads:
            merges = result.shape[-1] == x.shape[-2] * x.shape[-1] and result.numel() == x.numel()
            if merges:  # (..., heads, head_dim) -> (..., heads * head_dim)
                self.merged[id(result)] = weakref.ref(result)

    def _decide(self, name: str, style: str | None) -> None:
        self.pending.discard(name)
        if style is not None:
            self.found[name] = style
        if not self.pending:
            raise _Decided


def _layout(func, args, kwargs, x: torch.Tensor, result, heads: set[int], tp: int) -> str | None:
    """The style the consuming op implies, or ``None`` when it says nothing this package can split by."""
    if func in CUTS:
        return per_part_style(cut_sizes(args, kwargs, x, result) or (), tp)
    if func in VIEWS and isinstance(result, torch.Tensor) and result.dim() in (x.dim() + 1, x.dim() + 2):
        count = result.shape[x.dim() - 1]
        if result.shape[: x.dim() - 1] == x.shape[:-1] and count in heads and count % tp == 0:
            return "colwise"
    return None


def per_part_style(sizes: tuple[Part, ...], tp: int) -> str | None:
    """The per-part column split (``fused_colwise:A,B,...``) of an output cut into ``sizes``, when tp divides every
    part split per rank (a part ``"*N"`` is whole on every rank); ``None`` otherwise."""
    if len(sizes) < 2 or any(isinstance(size, int) and size % tp for size in sizes):
        return None
    return f"fused_colwise:{','.join(map(str, sizes))}"


def with_traced_layouts(
    module: nn.Module,
    blocks_name: str,
    plan: dict[str, str],
    unknown: dict[str, str],
    tp: int,
    contested: dict[str, str] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """``plan`` with entries for the unknown fused layers a fake forward shows the layout of (the rest stay
    unknown), and the ``contested`` patterns (pattern -> a module it names) set to what the forward shows.

    Example::

        plan, unknown = with_traced_layouts(module, "model.layers", plan, unknown, tp=2)
    """
    contested = contested or {}
    fused = [name for name in unknown if FUSED_NAME.match(name.rpartition(".")[2].lower())]
    unnamed = [name for name in unknown if name not in fused and _is_linear(module, name)]
    names = fused + unnamed + sorted(set(contested.values()) - set(fused))
    found = trace_fused_layouts(module, blocks_name, names, tp) if names else {}
    for name, style in found.items():
        log.info("tensor parallel: %s is split as %r, read off the model's use of its tensors", name, style)
    traced = {pattern_of(name): style for name, style in found.items() if name in fused or name in unnamed}
    traced |= {pattern: found[name] for pattern, name in contested.items() if name in found}
    return {**plan, **traced}, {n: why for n, why in unknown.items() if n not in found}


def trace_fused_layouts(module: nn.Module, blocks_name: str, names: list[str], tp: int) -> dict[str, str]:
    """Module name -> style for the fused ``names`` (inside the blocks) whose layout one fake forward shows.

    The forward is the first of these that reaches the blocks: the modules on the path to them, innermost
    first, each called with token ids (a Hugging Face ``ForCausalLM``, litgpt's ``GPT``, a user's model taking
    ``ids``). When the first block is called, the blocks holding ``names`` are called with its inputs instead
    and the forward stops: no earlier block's experts (data-dependent routing fake tensors cannot run) stand
    in the way. Example::

        trace_fused_layouts(lightning_module, "model.transformer.blocks", ["model.transformer.blocks.0.attn.Wqkv"], 2)
        # {"model.transformer.blocks.0.attn.Wqkv": "fused_colwise:32,32,32"}
    """
    heads = head_counts(module)
    parts = blocks_name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        runner = module.get_submodule(".".join(parts[:depth])) if depth else module
        follow = _Follow(names, heads, tp)
        if _run(module, runner, blocks_name, follow):
            if follow.pending and "use_cache" in inspect.signature(runner.forward).parameters:
                # Again without a KV cache for what is left: a hybrid model's cache holds one kind of layer per
                # index (Zamba2's), and the holders run with the first block's inputs, its cache included.
                again = _Follow(sorted(follow.pending), heads, tp)
                _run(module, runner, blocks_name, again, use_cache=False)
                return {**follow.found, **again.found}
            return follow.found
    return {}


class _Stop(Exception):
    """The blocks holding the watched layers have run: the model's own forward is not needed further."""


def _run(module: nn.Module, runner: nn.Module, blocks_name: str, follow: _Follow, **kwargs) -> bool:
    """Run ``runner`` on fake token ids (and ``kwargs``) under ``follow``; whether it reached the blocks."""
    device = next(module.parameters()).device
    ids = torch.zeros(1, _TOKENS, dtype=torch.long, device="cpu" if device.type == "meta" else device)
    blocks = module.get_submodule(blocks_name)
    keys = [key for key, _ in blocks.named_children()]  # a ModuleDict's keys, a list's indices
    holders = sorted({keys.index(n[len(blocks_name) + 1 :].split(".")[0]) for n in follow.pending})
    hooks = [
        module.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: follow.watch(n, out))
        for n in follow.pending
    ] + [
        module.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: follow.watch_input(n, a))
        for n in follow.pending
    ]

    def at_first_block(block: nn.Module, args: tuple, kwargs: dict) -> None:
        for handle in block_hooks:
            handle.remove()
        for index in holders:
            try:
                block_modules(blocks)[index](*args, **kwargs)
            except (_Decided, _Stop):
                raise
            except Exception as error:  # this block's forward cannot run on fake tensors, or on these inputs
                log.debug("tracing fused layouts: block %d stopped: %s", index, error)
        raise _Stop

    block_hooks = [b.register_forward_pre_hook(at_first_block, with_kwargs=True) for b in blocks.children()]

    def forward() -> None:
        with follow:
            runner(ids, **kwargs)

    try:
        with redirected_log(module), torch.no_grad():
            fake_parameters(module, forward, device=ids.device)
    except (_Decided, _Stop):
        return True
    except Exception as error:  # a forward that cannot run on fake tensors, or on token ids alone
        log.debug("tracing fused layouts through %s stopped: %s", type(runner).__name__, error)
        return False
    finally:
        for hook in hooks + block_hooks:
            hook.remove()
    return True  # the whole forward ran (a model that calls its blocks' parts, not the blocks)


def _is_linear(module: nn.Module, name: str) -> bool:
    try:
        return isinstance(module.get_submodule(name), nn.Linear)
    except AttributeError:
        return False


def head_counts(module: nn.Module) -> set[int]:
    """Every head count a config or attention module of ``module`` states (query and key/value heads)."""
    counts = set()
    for sub in module.modules():
        for owner in (sub, getattr(sub, "config", None)):
            for attr in HEAD_ATTRS:
                value = attribute(owner, attr)
                if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                    counts.add(value)
    return counts
