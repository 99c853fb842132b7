"""The work of one training forward, op by op, as one rank does it: FLOPs, bytes moved, launches, and the collectives
tensor parallelism adds, recorded on fake tensors (nothing allocated, a 70B model on a laptop).

Each aten op the forward dispatches (views, which move nothing, aside) is counted with its FLOPs (torch's own
``flop_registry``, the table its ``FlopCounterMode`` uses) and the bytes of its inputs and outputs (what a
memory-bound op moves). Under tensor parallelism the rank's share follows the dataflow
(:mod:`.tp_shares`): an op inside a column or row split, or reading or making a head-sharded tensor, does ``1/tp`` of
the work; an op on the residual stream does all of it (``1/tp`` under sequence parallelism). Each call of a split
module is also a collective the run makes: a row split's all-reduce (a reduce-scatter under sequence parallelism),
and under sequence parallelism each column split's all-gather; backward makes the mirror ones. Scaled dot-product
attention calls are kept apart (their keys and values are what context parallelism's ring passes on).
:mod:`lightning_llm.planning.step_time` turns this into seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from functools import partial

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from lightning_llm._compat.torch import TorchDispatchMode, tree_leaves
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.modeling.experts import expert_count
from lightning_llm.modeling.fake import fake_parameters
from lightning_llm.modeling.log_redirect import redirected_log
from lightning_llm.modeling.repeated_blocks import measure_repeated
from lightning_llm.modeling.tp_shares import SPLIT, TensorParallelShares
from lightning_llm.planning.work import ForwardWork, Work

_VIEWS = frozenset(
    {
        "view", "_unsafe_view", "t", "transpose", "expand", "permute", "unsqueeze", "squeeze", "detach", "alias",
        "slice", "select", "split", "split_with_sizes", "unbind", "as_strided", "_reshape_alias", "lift_fresh",
        "unflatten", "chunk", "expand_as", "view_as", "movedim", "diagonal",
    }
)  # fmt: skip
_ATTENTION = ("_scaled_dot_product", "scaled_dot_product")
_PARTS = frozenset({"select", "slice", "index", "embedding"})  # a part of a tensor: its backward fills a whole one


def _is_parameter(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and tensor.is_leaf


class _Recorder(TorchDispatchMode):
    """Adds each op's FLOPs and bytes, weighed by the rank's share, to the running block's :class:`Work`."""

    def __init__(self, work: ForwardWork, shares: TensorParallelShares | None) -> None:
        super().__init__()
        self.work, self.shares, self.block, self.in_experts = work, shares, None, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        target = self.work.outside if self.block is None else self.work.blocks[self.block]
        if not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            return out  # queries (a tensor's device) launch nothing
        experts = self.work.experts[self.block] if self.in_experts and self.block is not None else Work()
        target.dispatches += name != "detach"  # what selective checkpointing's policy is asked about: views too
        experts.dispatches += name != "detach"
        if name in _PARTS and _is_parameter(args[0]):  # its backward: a zero-filled whole, added to the gradient
            # (an embedding, read once, has nothing to add it to)
            whole = (1 if name == "embedding" else 2) * args[0].numel() * args[0].element_size()
            target.backward_bytes += whole
            experts.backward_bytes += whole
        if name in _VIEWS:
            return out  # views move nothing
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        share = self._share(args, out)
        target.add(flops * share, nbytes * share)
        experts.add(flops * share, nbytes * share)
        if name.startswith(_ATTENTION) and self.block is not None:
            k, v = args[1], args[2]
            self.work.attention_kv_bytes[self.block] += k.numel() * k.element_size() + v.numel() * v.element_size()
            self.work.attention_flops[self.block] += flops * share
        return out

    def _share(self, args, out) -> float:
        shares = self.shares
        if shares is None:
            return 1.0
        if shares.inside_split():  # a column or row split, or the gathered head's matmul
            return 1 / shares.tp
        tensors = [t for t in tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
        if any(shares.mark_of(t) == SPLIT for t in tensors):
            return 1 / shares.tp
        return max((shares.fraction(t) for t in tensors), default=1.0)


def forward_work(
    module: nn.Module,
    step: Callable[[], object],
    shares: TensorParallelShares | None = None,
    device: torch.device | None = None,
) -> ForwardWork:
    """Record ``step()`` (one forward of ``module``, e.g. its ``training_step`` on a real-shaped batch) on fake tensors.

    ``shares``: one tensor-parallel rank's share of each op (:mod:`.tp_shares`); its split modules' calls are counted as
    the collectives the run makes. ``device``: the batch's (see :func:`.fake.fake_parameters`). A stack of identical
    blocks is recorded on its first two, the rest taken equal to the second (:mod:`.repeated_blocks`), so a deep
    model costs what a shallow one does. Example::

        work = forward_work(model, lambda: model.training_step(batch, 0))
        work.total.matmul_flops
    """
    name, blocks = find_blocks(module)
    blocks = list(blocks.children()) if isinstance(blocks, nn.Module) else list(blocks)
    recorded: list[ForwardWork] = []

    def measure(sample: list[nn.Module]) -> list[int]:
        recorded.append(_record(module, sample, step, shares, device))
        return list(range(len(sample)))

    with redirected_log(module):
        sampled = measure_repeated(module, name, blocks, measure) or measure(blocks)
    work = recorded[-1]
    whole = ForwardWork(
        blocks=[work.blocks[i] for i in sampled],
        outside=work.outside,
        collectives=[c for c in work.collectives if c[3] is None],
        attention_kv_bytes=[work.attention_kv_bytes[i] for i in sampled],
        attention_flops=[work.attention_flops[i] for i in sampled],
        stream_bytes=work.stream_bytes,
        experts=[work.experts[i] for i in sampled],
        routed_bytes=[work.routed_bytes[i] for i in sampled],
    )
    for index, sample in enumerate(sampled):
        whole.collectives += [(phase, kind, size, index) for phase, kind, size, at in work.collectives if at == sample]
    return whole


def _record(
    module: nn.Module, blocks: list[nn.Module], step: Callable, shares: TensorParallelShares | None, device
) -> ForwardWork:
    """One fake forward of ``module`` through ``blocks``, recorded."""
    n = len(blocks)
    work = ForwardWork([Work() for _ in blocks], Work(), [], [0] * n, [0.0] * n, 0, [Work() for _ in blocks], [0] * n)
    recorder = _Recorder(work, shares)

    def run() -> None:
        with ExitStack() as stack:
            for index, block in enumerate(blocks):
                pre = block.register_forward_pre_hook(partial(_entered, recorder, work, index), with_kwargs=True)
                post = block.register_forward_hook(lambda *_: setattr(recorder, "block", None), always_call=True)
                stack.callback(pre.remove)
                stack.callback(post.remove)
            for experts in (m for m in module.modules() if expert_count(m) is not None):
                pre = experts.register_forward_pre_hook(partial(_routed, recorder, work), with_kwargs=True)
                post = experts.register_forward_hook(
                    lambda *_: setattr(recorder, "in_experts", False), always_call=True
                )
                stack.callback(pre.remove)
                stack.callback(post.remove)
            if shares is not None:
                stack.enter_context(shares.tracking())
                for part, role in shares.roles.items():
                    handle = part.register_forward_hook(
                        lambda m, a, o, role=role: _collectives(work, recorder.block, role, a, o, shares)
                    )
                    stack.callback(handle.remove)
            stack.enter_context(recorder)
            stack.enter_context(torch.enable_grad())  # the ops a training forward dispatches
            step()

    fake_parameters(module, run, device=device)
    return work


def _entered(recorder: _Recorder, work: ForwardWork, index: int, module, args, kwargs) -> None:
    recorder.block = index
    hidden = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
    if index == 0 and hidden is not None:
        work.stream_bytes = hidden.numel() * hidden.element_size()


def _routed(recorder: _Recorder, work: ForwardWork, module, args, kwargs) -> None:
    """An experts module's call: its rows (one per token and chosen expert, ``(tokens, dim)`` hidden states and
    ``(tokens, k)`` expert ids, Hugging Face's and the reference model's order) are what expert parallelism moves."""
    recorder.in_experts = True
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if recorder.block is not None and len(tensors) >= 2:
        hidden, ids = tensors[:2]
        work.routed_bytes[recorder.block] += ids.numel() * hidden.shape[-1] * hidden.element_size()


def _collectives(work: ForwardWork, block, role: str, args, output, shares: TensorParallelShares) -> None:
    """The collectives one split module's call makes, forward and backward (bytes of the whole tensor).

    Torch's styles: a row split sums its output (all-reduce; under sequence parallelism a reduce-scatter, whose
    backward all-gathers); a column split's replicated input gets its gradient summed in backward (all-reduce), and
    under sequence parallelism it all-gathers its input's shards (backward: reduce-scatter); the gathered head
    all-gathers its output besides.
    """
    inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    if not inputs or not outputs:
        return
    sp, add = shares.sequence_parallel, work.collectives.append
    x, y = (t.numel() * t.element_size() for t in (inputs[0], outputs[0]))
    if role == "closes":
        add(("forward", "reduce_scatter" if sp else "all_reduce", y, block))
        if sp:
            add(("backward", "all_gather", y, block))
        return
    if role == "gathers":
        add(("forward", "all_gather", y, block))
    if sp:
        add(("forward", "all_gather", x, block))
    add(("backward", "reduce_scatter" if sp else "all_reduce", x, block))
