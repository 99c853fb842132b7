"""The output head's matmul and the cross-entropy loss in chunks of tokens: the logits are never whole.

A decoder's logits are the largest tensor of its training step: tokens × vocabulary (8192 × 128256 for the 1B preset
at batch 4 × 2048, 2 GiB in bf16), and ``F.cross_entropy(logits.float(), targets)`` keeps an fp32 copy and its
log-softmax besides. :func:`linear_cross_entropy` takes the hidden states and the head's weight instead, and
computes the loss and both gradients one chunk of tokens at a time in the forward, as Liger-Kernel does: per chunk the
logits, their log-sum-exp, the loss, the gradient of the logits, and from it at once the chunk's gradient of the
hidden states and its share of the weight's. The backward only scales what the forward stored by the incoming
gradient. Nothing is computed twice (no extra FLOPs), and what lives from forward to backward is the two gradients
(tokens × dim and vocabulary × dim, fp32), not the logits; the peak adds one chunk's logits.

The gradients of the logits are kept unscaled (softmax minus one-hot, within [-1, 1]) while they are in the compute
dtype, and divided by the token count in fp32 afterwards, so fp16's narrow range cannot flush them to zero before a
loss scaler has multiplied them (it multiplies in the backward, after them).

:func:`head_cross_entropy` runs the same through a head module's own hooks (FSDP2 gathers its weight there).
On CUDA with ``liger-kernel`` installed, ``implementation="auto"`` uses Liger's Triton kernel instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm._compat.versions import torch_at_least
from lightning_llm.validation import check_choice, check_int

IMPLEMENTATIONS = ("auto", "torch", "liger")
# A chunk's fp32 logits take at most this many bytes when no chunk size is given (see default_chunk_size).
CHUNK_LOGITS_BYTES = 2**29
# Mesh axes FSDP2 and replicate shard or copy parameters over: lightning_llm.parallel.mesh's data-parallel axes and
# Lightning's ModelParallelStrategy's. A head's DTensor weight on any other axis is split by tensor parallelism.
DATA_PARALLEL_AXES = frozenset({"dp", "dp_replicate", "dp_shard", "dp_shard_cp", "dp_cp", "data_parallel"})
# Pipelining's zero-bubble schedules split a backward at the nodes the input and weight gradients share, and the
# weight pass asks such a node for its input metadata, which torch < 2.13 cannot give for a Python Function's node
# ("Attribute '_input_metadata' is invalid for this instance of _C._FunctionBase", seen on torch 2.11 with
# InterleavedZeroBubble). There the weight's gradient leaves the Function by built-in ops instead.
WEIGHT_GRAD_THROUGH_FUNCTION = torch_at_least("2.13")


def default_chunk_size(vocab_size: int, tokens: int) -> int:
    """Tokens per chunk: all of them where their fp32 logits fit in ``CHUNK_LOGITS_BYTES``, else an eighth of
    them, at most as many as fit (a multiple of 64 from 64 up): 1024 of 8192 tokens at a 128256 vocabulary.

    Chunks are kept large because each one adds a pass over the weight's gradient (vocabulary × dim, fp32) besides
    its matmuls; an eighth bounds the logits held at once to a small share of the whole.
    """
    fit = max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size))
    if tokens <= fit:
        return tokens
    size = min(fit, -(-tokens // 8))
    return size - size % 64 if size >= 64 else size


def vocab_parallel(weight: torch.Tensor | None) -> bool:
    """Whether a head's ``weight`` is split over its vocabulary by tensor parallelism (its rows on other ranks).

    Such a head's logits are gathered by its own tensor-parallel hooks, which a fused loss would bypass, so the
    chunked loss is not used for it. FSDP2's and replicate's DTensors (on :data:`DATA_PARALLEL_AXES`) do not count:
    they are whole again inside the head's call. A DTensor on an unnamed mesh counts, to be safe.
    """
    if not isinstance(weight, DTensor):
        return False
    names = weight.device_mesh.mesh_dim_names
    return names is None or not set(names) <= DATA_PARALLEL_AXES


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    implementation: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` (mean over the targets that are not
    ``ignore_index``) without the whole logits: computed ``chunk_size`` tokens at a time (see the module doc).

    Arguments:
        hidden: (..., dim) final hidden states; ``targets`` has the same leading shape.
        weight: (vocab, dim) the output head's weight (no bias).
        ignore_index: targets with this value add no loss and no gradient, as in ``F.cross_entropy``.
        chunk_size: tokens per chunk; ``None``: :func:`~lightning_llm.models.cross_entropy.default_chunk_size` (1024 of 8192 tokens at a 128K vocabulary).
        implementation: "torch" (this module's chunks), "liger" (Liger-Kernel's fused kernel, CUDA), or "auto":
            Liger on CUDA where ``liger-kernel`` is installed, else "torch".

    Under autocast the matmuls run in the autocast dtype, as ``F.linear`` would; the loss is fp32.

    Example::

        hidden = model(tokens, return_hidden=True)           # (batch, seq, dim)
        loss = linear_cross_entropy(hidden, model.output.weight, targets)
        loss.backward()
    """
    check_choice("implementation", implementation, IMPLEMENTATIONS)
    check_int("chunk_size", chunk_size, minimum=1, optional=True)
    if hidden.shape[:-1] != targets.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy needs hidden (..., dim), weight (vocab, dim) and targets shaped like hidden's "
            f"leading dims; got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets "
            f"{tuple(targets.shape)}."
        )
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    dtype = _compute_dtype(hidden)
    if _use_liger(implementation, hidden):
        return _liger(hidden.to(dtype), weight.to(dtype), targets, ignore_index)
    grads = (hidden.requires_grad, weight.requires_grad) if torch.is_grad_enabled() else (False, False)
    size = chunk_size or default_chunk_size(weight.shape[0], hidden.shape[0])
    if WEIGHT_GRAD_THROUGH_FUNCTION or not grads[1]:
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, ignore_index, size, dtype, grads)
    loss, grad_weight = _ChunkedLinearCrossEntropy.apply(
        hidden, weight.detach(), targets, ignore_index, size, dtype, grads, True
    )
    return _with_gradient(loss, weight, grad_weight)


def _with_gradient(loss: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged in value, with ``grad`` (times the incoming gradient) as its gradient for ``weight``,
    through built-in ops: ``link - link.detach()`` is exactly zero and its gradient is ``grad``."""
    link = (weight * grad).sum()
    return loss + (link - link.detach())


def head_cross_entropy(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, **options) -> torch.Tensor:
    """:func:`linear_cross_entropy` with ``head``'s weight, run as ``head``'s forward so that the hooks on ``head``
    run around it as around its matmul: FSDP2 gathers the weight before and reduces its gradient after, DeepSpeed
    ZeRO-3 fetches it. ``options``: those of :func:`linear_cross_entropy`.

    Example::

        hidden = self.model(inputs, return_hidden=True)
        loss = head_cross_entropy(self.model.output, hidden, targets)
    """
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"head_cross_entropy computes a head without bias; {type(head).__name__} has one. Compute its logits "
            "and F.cross_entropy instead (CausalLM(fused_cross_entropy=False))."
        )
    with _forward_replaced(head, lambda h: linear_cross_entropy(h, head.weight, targets, **options)):
        return head(hidden)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on for ``hidden``'s device (as ``F.linear`` would use), else its own."""
    device = hidden.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _autocast_off(device: str):
    """Autocast disabled for ``device``; nothing to disable where it has none (the meta device of measurements)."""
    return torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext()


@contextmanager
def _forward_replaced(module: nn.Module, forward: Callable) -> Iterator[None]:
    """``module.forward`` is ``forward`` inside the block: an instance attribute, so the class and hooks stay."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients in the forward, chunk by chunk; the backward scales the stored gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, dtype, needs_grads, return_grad_weight=False):
        with _autocast_off(hidden.device.type):
            loss, grad_hidden, grad_weight = _loss_and_grads(
                hidden,
                weight,
                targets,
                ignore_index=ignore_index,
                chunk_size=chunk_size,
                dtype=dtype,
                grads=needs_grads,
            )
        ctx.dtypes = hidden.dtype, weight.dtype
        if return_grad_weight:  # see WEIGHT_GRAD_THROUGH_FUNCTION: the caller attaches it to the weight
            ctx.save_for_backward(grad_hidden, None)
            ctx.mark_non_differentiable(grad_weight)
            return loss, grad_weight
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss, _grad_of_grad_weight=None):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # Out of place: a second backward (retain_graph=True) finds the stored gradients unchanged.
        grad_hidden = (grad_hidden * grad_loss).to(hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad_weight * grad_loss).to(weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int,
    chunk_size: int,
    dtype: torch.dtype,
    grads: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean loss and its fp32 gradients with respect to ``hidden`` (tokens, dim) and ``weight`` (vocab, dim)."""
    valid = targets != ignore_index
    # 1 / the number of targets that count, as F.cross_entropy's mean; a tensor, so no host sync (nan if none count).
    scale = 1.0 / valid.sum().float()
    picked = torch.where(valid, targets, 0)[:, None]
    w = weight.to(dtype)
    loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if grads[0] else None
    grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if grads[1] else None
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows].to(dtype)
        probs, target_logp = _softmax(h @ w.T, picked[rows])  # (chunk, vocab) fp32: the one tensor of that size
        ignored = ~valid[rows]
        loss -= target_logp.masked_fill(ignored, 0).sum()
        if any(grads):
            # d(loss)/d(logits) * count: softmax minus one-hot, zero on ignored targets.
            probs.scatter_add_(1, picked[rows], probs.new_full(picked[rows].shape, -1.0))
            grad_logits = probs.to(dtype).masked_fill_(ignored[:, None], 0)
            del probs
            if grads[0]:
                _product_into(grad_hidden[rows], grad_logits, w)
            if grads[1]:
                _accumulate(grad_weight, grad_logits.T, h)
            del grad_logits  # before the next chunk's logits are allocated: one chunk alive at a time
    loss = loss * scale
    for grad in (grad_hidden, grad_weight):
        if grad is not None:
            grad.mul_(scale)
    return loss, grad_hidden, grad_weight


def _softmax(logits: torch.Tensor, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' softmax in fp32 and the log-probability of each row's ``picked`` column.

    fp32 logits are overwritten in place (no second tensor of their size); lower-precision ones go through one
    ``log_softmax`` kernel computing in fp32, fewer passes over memory than an upcast followed by the steps below.
    """
    if logits.dtype != torch.float32:
        logp = torch.log_softmax(logits, 1, dtype=torch.float32)
        del logits
        target = logp.gather(1, picked).squeeze(1)
        return logp.exp_(), target
    target = logits.gather(1, picked).squeeze(1)
    top = logits.amax(1, keepdim=True)
    total = logits.sub_(top).exp_().sum(1, keepdim=True)
    return logits.div_(total), target - (total.log() + top).squeeze(1)


def _product_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out[:] = a @ b`` for an fp32 ``out``: written in place when ``a`` and ``b`` are fp32 too."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` with ``total`` in fp32: in place when ``a`` and ``b`` are fp32, else through their product
    in the compute dtype (rounded once per chunk, as the whole-logits path rounds its one product)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)


def _use_liger(implementation: str, hidden: torch.Tensor) -> bool:
    if implementation == "torch" or (implementation == "auto" and hidden.device.type != "cuda"):
        return False
    available = importlib.util.find_spec("liger_kernel") is not None
    if implementation == "liger" and not (available and hidden.device.type == "cuda"):
        raise RuntimeError(
            f"implementation='liger' needs liger-kernel installed (pip install liger-kernel) and CUDA tensors; "
            f"installed: {available}, device: {hidden.device}. Use implementation='auto' or 'torch'."
        )
    return available


def _liger(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    # The module's (weight, input, target) call has kept its order across Liger releases; the functional has not.
    return LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index)(weight, hidden, targets).float()
