"""The chunked linear cross-entropy against ``F.cross_entropy`` on whole logits, and its memory.

Oracle: ``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` and autograd through it, in fp32 within 1e-5.
Memory: torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) around one forward and backward, against
the bytes of the fp32 logits that the plain loss materializes (and keeps an fp32 log-softmax of besides).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.models import CausalLM, LlamaConfig, cross_entropy, head_cross_entropy, linear_cross_entropy
from lightning_llm.models.cross_entropy import default_chunk_size, vocab_parallel
from lightning_llm.testing import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(tokens: int = 37, dim: int = 16, vocab: int = 50, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=generator).requires_grad_()
    weight = torch.randn(vocab, dim, generator=generator).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    targets[::5] = -100  # ignored, as F.cross_entropy's default ignore_index
    return hidden, weight, targets


def _reference(hidden, weight, targets, **kwargs):
    loss = F.cross_entropy(F.linear(hidden, weight).float(), targets, **kwargs)
    return loss, *torch.autograd.grad(loss, (hidden, weight))


@pytest.mark.parametrize("chunk_size", [None, 1, 8, 36, 100], ids=lambda c: f"chunk{c}")
def test_loss_and_gradients_match_f_cross_entropy_in_fp32(chunk_size):
    hidden, weight, targets = _inputs()  # 37 tokens: 8 and 36 do not divide it
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size)
    got = (loss, *torch.autograd.grad(loss, (hidden, weight)))
    for a, b in zip(got, _reference(hidden, weight, targets)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("through_function", [True, False], ids=["function", "builtin_ops"])
def test_both_weight_gradient_routes_match_and_split_at_a_gradient_edge_as_zero_bubble_does(
    through_function, monkeypatch
):
    # builtin_ops: torch < 2.13's route (see WEIGHT_GRAD_THROUGH_FUNCTION), run on every torch here.
    monkeypatch.setattr(cross_entropy, "WEIGHT_GRAD_THROUGH_FUNCTION", through_function)
    hidden, weight, targets = _inputs()
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    want = _reference(hidden, weight, targets)
    # Pipelining's split backward: input gradients first, then weights from the loss node's gradient edge.
    (grad_hidden,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    edge = torch.autograd.graph.GradientEdge(loss.grad_fn, 0)
    (grad_weight,) = torch.autograd.grad([edge], [weight], grad_outputs=[torch.tensor(2.0)])
    for a, b in zip((loss, grad_hidden, grad_weight), (want[0], want[1], 2.0 * want[2])):
        torch.testing.assert_close(a, b, **TOL)


def test_batched_inputs_another_ignore_index_and_a_scaled_backward_twice():
    hidden, weight, targets = _inputs(tokens=24)
    hidden3d, targets2d = hidden.view(2, 12, -1), targets.clamp(min=0).view(2, 12)
    targets2d[0, :3] = 7
    loss = linear_cross_entropy(hidden3d, weight, targets2d, ignore_index=7, chunk_size=5)
    ref = F.cross_entropy(F.linear(hidden3d, weight).flatten(0, 1), targets2d.flatten(), ignore_index=7)
    torch.testing.assert_close(loss, ref, **TOL)
    # A loss scaler's (or accumulation's) factor reaches the stored gradients; retain_graph keeps them intact.
    for _ in range(2):
        got = torch.autograd.grad(3.0 * loss, (hidden, weight), retain_graph=True)
        want = torch.autograd.grad(3.0 * ref, (hidden, weight), retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)


def test_without_grad_only_the_loss_is_computed():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _reference(hidden, weight, targets)[0], **TOL)


def test_bf16_autocast_matches_the_autocast_logits_path():
    hidden, weight, targets = _inputs(tokens=64, dim=32, vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
        ref = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    assert loss.dtype == torch.float32
    got, want = torch.autograd.grad(loss, (hidden, weight)), torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).norm() <= 2e-2 * b.norm()


def test_peak_memory_at_a_128k_vocabulary_and_4k_tokens_is_under_a_quarter_of_the_logits():
    from torch.distributed._tools.mem_tracker import MemTracker

    tokens, dim, vocab = 4096, 64, 128_256
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=generator).requires_grad_()
    weight = (0.02 * torch.randn(vocab, dim, generator=generator)).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    tracker = MemTracker()
    with tracker:
        linear_cross_entropy(hidden, weight, targets).backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    logits = tokens * vocab * 4  # the fp32 logits F.cross_entropy(logits.float()) holds, before its log-softmax
    assert peak <= logits / 4, f"peak {peak / 2**20:.0f} MiB vs logits {logits / 2**20:.0f} MiB"
    assert weight.grad.shape == weight.shape and torch.isfinite(weight.grad).all()


def test_default_chunks_are_an_eighth_of_the_tokens_at_most_512_mib_of_fp32_logits_or_all_where_they_fit():
    assert default_chunk_size(128_256, 8192) == 1024
    assert default_chunk_size(128_256, 4096) == 512
    assert default_chunk_size(128_256, 65_536) == 1024  # 1046 fit in 512 MiB, rounded to 64
    assert default_chunk_size(256, 8192) == 8192  # 8 MiB of logits: one chunk
    assert default_chunk_size(10**9, 8192) == 1


def test_the_head_runs_through_its_own_hooks_and_keeps_its_forward():
    hidden, _, targets = _inputs()
    head = nn.Linear(16, 50, bias=False)
    calls = []
    head.register_forward_pre_hook(lambda m, args: calls.append(("pre", args[0].shape)))
    head.register_forward_hook(lambda m, args, out: calls.append(("post", out.shape)))
    loss = head_cross_entropy(head, hidden, targets, chunk_size=8)
    assert calls == [("pre", hidden.shape), ("post", torch.Size([]))]
    torch.testing.assert_close(loss, _reference(hidden, head.weight, targets)[0], **TOL)
    assert "forward" not in head.__dict__ and head(hidden).shape == (37, 50)
    with pytest.raises(ValueError, match="without bias"):
        head_cross_entropy(nn.Linear(16, 50), hidden, targets)


def test_bad_arguments_are_refused_by_name():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="implementation"):
        linear_cross_entropy(hidden, weight, targets, implementation="triton")
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="targets shaped like"):
        linear_cross_entropy(hidden, weight, targets[:-1])
    with pytest.raises(RuntimeError, match="liger-kernel"):  # CPU tensors (and here, no liger-kernel)
        linear_cross_entropy(hidden, weight, targets, implementation="liger")
    with pytest.raises(ValueError, match="loss_chunk_size"):
        CausalLM("tiny", loss_chunk_size=0)


def _placements():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = torch.randn(8, 4)
    answers = {}
    for name in ("tp", "tensor_parallel", "dp_shard", "dp", "data_parallel"):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=(name,))
        answers[name] = vocab_parallel(distribute_tensor(weight, mesh, [Shard(0)]))
    return answers


@pytest.mark.distributed
def test_only_a_tensor_parallel_head_counts_as_vocab_parallel():
    (answers,) = run_distributed(_placements, 1, timeout=120)
    assert answers == {"tp": True, "tensor_parallel": True, "dp_shard": False, "dp": False, "data_parallel": False}
    assert not vocab_parallel(torch.randn(8, 4)) and not vocab_parallel(None)


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_causal_lm_trains_the_same_with_and_without_the_fused_loss(documents):
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    if documents:
        batch = {"input_ids": batch, "document_ids": torch.arange(33).div(10, rounding_mode="floor").expand(2, -1)}
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        module = CausalLM(
            LlamaConfig.from_name("tiny", tie_embeddings=True), fused_cross_entropy=fused, loss_chunk_size=7
        )
        module.configure_model()
        loss = module._loss(batch)
        results.append((loss, torch.autograd.grad(loss, list(module.parameters()))))
    (loss, grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)


class _OwnForward(CausalLM):
    def forward(self, tokens, document_ids=None):  # a subclass's forward from before return_hidden
        return super().forward(tokens, document_ids)


def test_a_subclass_forward_without_return_hidden_keeps_the_logits_path():
    module = _OwnForward("tiny")
    module.configure_model()
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    logits = module.model(batch[:, :-1])
    want = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    plain = CausalLM("tiny")
    plain.configure_model()
    assert plain._fuses_loss() and not module._fuses_loss()
    torch.testing.assert_close(module._loss(batch), want, **TOL)
