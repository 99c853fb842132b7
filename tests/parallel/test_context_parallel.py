"""Context parallelism's parts: zig-zag layout, and the attention of a shard against torch's SDPA on the whole
sequence (forward and every gradient), on 2 gloo ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_llm.parallel.cp.attention import context_parallel_attention, count_queries
from lightning_llm.parallel.cp.interception import attend
from lightning_llm.parallel.cp.layout import CPGroup, check_sequence_length, gathered_to_global, zigzag_positions
from lightning_llm.parallel.cp.masks import record_documents
from lightning_llm.parallel.cp.ring import ring_attention
from lightning_llm.parallel.cp.ulysses import ulysses_attention
from lightning_llm.testing import run_distributed


@pytest.mark.timeout(30)
def test_zigzag_positions_balance_causal_work():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    shards = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert torch.equal(shards[gathered_to_global(24, 3)], torch.arange(24))
    # Causal (query, key) pairs per rank: equal for every rank.
    work = [int((zigzag_positions(24, 3, r) + 1).sum()) for r in range(3)]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 4"):
        check_sequence_length(10, 2)


def _attention_matches_sdpa(cases, method="allgather", dtype=torch.float64):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    cp = CPGroup(dist.group.WORLD, size, rank)
    results = []
    for heads, kv_heads, seq, causal, qk_dim, v_dim in cases:
        gen = torch.Generator().manual_seed(seq + heads)
        q, k = (torch.randn(2, h, seq, qk_dim, generator=gen, dtype=dtype) for h in (heads, kv_heads))
        v = torch.randn(2, kv_heads, seq, v_dim, generator=gen, dtype=dtype)
        grad_out = torch.randn(2, heads, seq, v_dim, generator=gen, dtype=dtype)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=heads != kv_heads)
        want.backward(grad_out)
        pos = zigzag_positions(seq, size, rank)
        local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        seen = []
        attention = {"ring": ring_attention, "ulysses": ulysses_attention}.get(method, context_parallel_attention)
        with count_queries(lambda positions, keys: seen.append((positions.tolist(), keys))):
            got = attention(*local, cp, is_causal=causal, scale=None)
        got.backward(grad_out[:, :, pos])
        errors = [(got - want[:, :, pos]).abs().max().item()]
        for mine, ref in zip(local, full):  # each rank's gradient of its shard of q, k and v
            errors.append((mine.grad - ref.grad[:, :, pos]).abs().max().item())
        results.append((max(errors), sorted({p for positions, _ in seen for p in positions}), pos.tolist(), seen))
    return results


# (heads, key/value heads, sequence, causal, query/key head dim, value head dim): the last two latent attention's
# unequal head dims (DeepSeek's MLA: values narrower than queries/keys), and the reverse.
CASES = [(4, 2, 16, True, 8, 8), (4, 4, 8, True, 8, 8), (6, 2, 24, True, 8, 8), (4, 2, 16, False, 8, 8)]
CASES += [(4, 1, 8, True, 8, 8), (4, 4, 16, True, 12, 8), (4, 2, 8, False, 8, 12)]
RUNS = [
    ("allgather", torch.float64, 1e-12),
    ("ring", torch.float64, 1e-12),
    ("ring", torch.float32, 1e-5),
    ("ulysses", torch.float64, 1e-12),
]


def _every_method(runs):
    """All runs in one spawned group (each call initializes the group once), then the masked cases."""
    results = [_attention_matches_sdpa(CASES, method, dtype) for method, dtype, _ in runs]
    masked = _masked_attention_matches_sdpa(MASKED)
    mixers, local = _mixers_match_one_process(MIXER_CASES), _mixers_match_one_process(LOCAL_CASES, seq=32)
    return results, masked, mixers, _ring_peaks(), local, _shorter_after_halo()


def _shorter_after_halo():
    """A convolution probed with a halo of 2 on 32 positions, then called on 4 (chunks of 1, shorter than its halo):
    (max error of that call's output and input gradient against one process, the (batch, seq) it computed on)."""
    from lightning_llm.parallel.cp.gathered import GatheredMixer, gather_mixers

    rank, size = dist.get_rank(), dist.get_world_size()
    cp, module = CPGroup(dist.group.WORLD, size, rank), _Local("conv")
    x = torch.randn(1, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    full = x.clone().requires_grad_()
    want = module(full)  # one process, before the hooks
    want.sum().backward()
    handles = gather_mixers([GatheredMixer("mixer", module, whole_block=False)], cp)
    module(torch.randn(1, 32, 6, dtype=torch.float64)[:, zigzag_positions(32, size, rank)])  # decides the halo
    pos = zigzag_positions(4, size, rank)
    local = x[:, pos].clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = module(local)
    got.sum().backward()
    for handle in handles:
        handle.remove()
    errors = [(got - want[:, pos]).abs().max(), (local.grad - full.grad[:, pos]).abs().max()]
    return max(e.item() for e in errors), module.seen[-1]


def _ring_peak(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Peak bytes (MemTracker) of the ring's forward and backward on this rank, inputs included."""
    from torch.distributed._tools.mem_tracker import MemTracker

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    tracker = MemTracker()
    with tracker:
        ring_attention(q, k, v, CPGroup(None, dist.get_world_size(), dist.get_rank())).sum().backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return max(peak.values())


def _ring_peaks() -> tuple[int, int, int]:
    """The ring's peak with 8 query heads over 2 key/value heads as they are, and over the same keys and values
    repeated to 8 heads beforehand (as the ring repeated them per step before); one q/k/v set's bytes."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(2, 8, 512, 32, generator=gen)
    k, v = (torch.randn(2, 2, 512, 32, generator=gen) for _ in range(2))
    repeated = [t.repeat_interleave(4, dim=1) for t in (k, v)]
    return _ring_peak(q, k, v), _ring_peak(q, *repeated), q.numel() * q.element_size()


# (window, packed documents): Hugging Face's sliding window (key k visible to query q iff q - window < k <= q),
# the package's packed documents (same document and causal), both.
MASKED = [(5, False), (None, True), (3, True), (16, False)]


def _masked_attention_matches_sdpa(cases):
    """Each rule through ``attend`` (which takes the all-gather path for it) against SDPA with the full mask built
    by hand on the whole sequence; float64. Returns (max error, ((query positions, keys) per kernel call))."""
    rank, size = dist.get_rank(), dist.get_world_size()
    cp, results = CPGroup(dist.group.WORLD, size, rank, "ring"), []
    for window, packed in cases:
        gen = torch.Generator().manual_seed(7)
        q, k, v, grad_out = (torch.randn(2, h, 16, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
        documents = torch.tensor([[0] * 3 + [1] * 9 + [2] * 4, [0] * 10 + [1] * 6]) if packed else None
        i = torch.arange(16)
        allowed = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - window) if window else True)
        allowed = allowed[None, None] & (documents[:, None, :, None] == documents[:, None, None, :] if packed else True)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, attn_mask=allowed, enable_gqa=True)
        want.backward(grad_out)
        pos = zigzag_positions(16, size, rank)
        local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        record_documents(documents)
        seen = []
        with count_queries(lambda positions, keys: seen.append((positions.tolist(), keys))):
            got = attend(*local, cp, is_causal=True, scale=None, window=window)
        record_documents(None)
        got.backward(grad_out[:, :, pos])
        errors = [(got - want[:, :, pos]).abs().max().item()]
        errors += [(mine.grad - ref.grad[:, :, pos]).abs().max().item() for mine, ref in zip(local, full)]
        results.append((max(errors), seen))
    return results


_runs: list = []


def _results():
    if not _runs:
        _runs.append(run_distributed(_every_method, 2, RUNS))
    return _runs[0]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_attention_of_shards_equals_sdpa_on_the_whole_sequence():
    """Every CP attention (keys/values all-gathered; the send/recv ring merging partials by log-sum-exp with a
    per-block flash backward from the merged output; Ulysses' all-to-all to heads, key/value heads repeated when
    fewer than the ranks), causal and not, GQA and MHA, value heads narrower or wider than query/key heads (latent
    attention; the ring's flash kernel needs one head size): outputs and q/k/v gradients
    match full SDPA (float64 1e-12, float32 1e-5); each rank's kernel computed exactly its own queries, each query
    chunk over only the keys up to its diagonal."""
    for rank, (per_run, *_) in enumerate(_results()):
        for (method, dtype, tolerance), results in zip(RUNS, per_run):
            for (heads, kv_heads, seq, causal, *_), (error, queries, own, calls) in zip(CASES, results):
                label = (method, dtype, rank, heads, kv_heads, seq, causal)
                assert error < tolerance, (*label, error)
                # Ulysses: every position, for heads / C heads; the others: exactly this rank's shard
                assert queries == (list(range(seq)) if method == "ulysses" else own), (*label, queries, own)
                if causal and method == "allgather":
                    chunk = seq // 4
                    assert [keys for _, keys in calls] == [(i + 1) * chunk for i in (rank, 3 - rank)]
                if causal and method == "ring":  # 5 of the 8 (query, key) chunk pairs on each rank: balanced
                    assert len(calls) == 5, (*label, calls)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_ring_passes_grouped_key_value_heads_as_they_are():
    """The ring hands grouped-query attention's key/value heads to the kernel as they are (CPU's and CUDA's flash
    kernels take them grouped) instead of repeating them to the query heads at every step: with 4 query heads per
    key/value head its forward and backward peak at most 0.6 of the same attention over keys and values repeated
    beforehand (measured 7.8 against 14.6 MiB; the ring repeating per step measured 14.0 and 18.5: the repeated
    keys, values and their gradients, 4 query-sized tensors at 4 groups), exact against SDPA as the GQA cases above
    show."""
    for grouped, repeated, query in (result[3] for result in _results()):
        assert grouped < 0.6 * repeated, (grouped / 2**20, repeated / 2**20)
        assert repeated - grouped > 3 * query, (grouped / 2**20, repeated / 2**20, query / 2**20)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_sliding_windows_and_packed_documents_are_applied_by_global_position():
    """A sliding window, packed documents and both, through the CP attention at C=2: output and q/k/v gradients equal
    SDPA with the whole-sequence mask (float64, 1e-12); each query chunk's kernel call reads only the keys from its
    window's left edge to its diagonal (chunk 4 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)."""
    for rank, (_, masked, *_) in enumerate(_results()):
        for (window, packed), (error, calls) in zip(MASKED, masked):
            assert error < 1e-12, (rank, window, packed, error)
            starts = [positions[0] for positions, _ in calls]
            assert starts == [4 * c for c in ((0, 3) if rank == 0 else (1, 2))], calls
            # keys from max(0, start - window + 1) to the chunk's end
            want = [start + 4 - (max(0, start - window + 1) if window else 0) for start in starts]
            assert [keys for _, keys in calls] == want, (rank, window, calls)


class _Recurrent(torch.nn.Module):
    """A causal depthwise convolution and a decaying running sum over the sequence, per sample: a sequence mixer
    that is not attention. Records the (batch, seq) it computes on."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(6, 6, 3, groups=6, padding=2, dtype=torch.float64)
        self.proj = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.seen: list[tuple[int, int]] = []

    def forward(self, x, mask=None, bias=None, scale=None):
        self.seen.append(tuple(x.shape[:2]))
        h = self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        h = h if mask is None else h * mask[..., None]
        h = h if bias is None else h + bias
        h = h if scale is None else h * scale[:, None]
        decay = 0.9 ** torch.arange(x.shape[1], dtype=x.dtype)
        return self.proj(torch.cumsum(h / decay[:, None], dim=1) * decay[:, None]), h.sum()


class _Local(torch.nn.Module):
    """Sequence mixers whose output at ``t`` reads a few positions back: a gated short convolution (LFM2's), a token
    shift (RWKV's), position-wise layers; and the short convolution adding a position table by absolute position,
    which the halo cannot run (a chunk's positions would look up the wrong rows). Records the (batch, seq) it
    computes on."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.seen = kind, []
        self.proj = torch.nn.Linear(6, 18, dtype=torch.float64)
        self.conv = torch.nn.Conv1d(6, 6, 3, groups=6, padding=2, dtype=torch.float64)
        self.out = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.table = torch.nn.Parameter(torch.randn(64, 6, dtype=torch.float64))

    def forward(self, x, mask=None):
        self.seen.append(tuple(x.shape[:2]))
        x = x if mask is None else x * mask[..., None]
        b, c, h = self.proj(x).chunk(3, dim=-1)
        if self.kind == "position-wise":
            return self.out(b * F.silu(h)) + self.table[:1]
        if self.kind == "shift":
            return self.out(h * F.pad(b, (0, 0, 1, 0))[:, :-1] + c) + self.table[:1]
        if self.kind == "fast decay":  # a recurrence whose reach falls below the last bit within a few positions
            states = [h[:, 0]]
            for t in range(1, x.shape[1]):
                states.append(1e-3 * states[-1] + h[:, t])
            return self.out(c * torch.stack(states, dim=1)) + self.table[:1]
        conv = self.conv((b * h).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.out(c * conv) + self.table[: x.shape[1] if self.kind == "absolute" else 1]


# (module, batch, extra inputs): batch 2 splits by rows (each rank whole sequences of one row), batch 1 and an input
# with the batch dimension but no sequence (``scale``) gather the sequence instead; ``bias`` is broadcast over the
# batch. The recurrence reads every earlier position: not local, so it runs on whole sequences.
MIXER_CASES = [(_Recurrent, 2, ()), (_Recurrent, 1, ()), (_Recurrent, 2, ("mask", "bias")), (_Recurrent, 2, ("scale",))]
# (kind, batch, extra inputs, the halo width it runs with or None): 32 positions, chunks of 8
LOCAL_CASES = [("conv", 1, (), 2), ("conv", 2, ("mask",), 2), ("shift", 1, (), 1), ("position-wise", 1, (), 0)]
LOCAL_CASES += [("absolute", 1, (), None), ("absolute", 2, (), None), ("fast decay", 1, (), None)]


def _mixers_match_one_process(cases, seq=16):
    """A module run through the hooks against the same module on the whole batch, one process: (max error of
    outputs, input and parameter gradients; the (batch, seq) it computed on; the warnings)."""
    from lightning_llm.parallel.cp.gathered import GatheredMixer, gather_mixers

    rank, size = dist.get_rank(), dist.get_world_size()
    cp, results = CPGroup(dist.group.WORLD, size, rank), []
    pos = zigzag_positions(seq, size, rank)
    for make, batch, extras, *_ in cases:
        torch.manual_seed(0)
        module = make() if make is _Recurrent else _Local(make)
        gen = torch.Generator().manual_seed(batch)
        x, grad_out = (torch.randn(batch, seq, 6, generator=gen, dtype=torch.float64) for _ in range(2))
        inputs = {"mask": (torch.rand(batch, seq, generator=gen) > 0.2).double(),
                  "bias": torch.randn(1, seq, 6, generator=gen, dtype=torch.float64),
                  "scale": torch.rand(batch, 1, generator=gen, dtype=torch.float64)}  # fmt: skip
        kwargs = {name: inputs[name] for name in extras}
        full = x.clone().requires_grad_()
        want = _first(module(full, **kwargs))
        want.backward(grad_out)
        ref_grads = [_grad(p) for p in module.parameters()]
        module.zero_grad()
        handles = gather_mixers([GatheredMixer("mixer", module, whole_block=False)], cp)
        local = x[:, pos].clone().requires_grad_()
        shard = lambda t: t[:, pos] if t.shape[1] == seq else t  # noqa: E731
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _first(module(local, **{k: shard(v) for k, v in kwargs.items()}))
        got.backward(grad_out[:, pos])
        for handle in handles:
            handle.remove()
        grads = [_grad(p) for p in module.parameters()]
        for grad in grads:
            dist.all_reduce(grad)  # each rank's part of the parameter gradients (what data parallelism sums)
        errors = [(got - want[:, pos]).abs().max(), (local.grad - full.grad[:, pos]).abs().max()]
        errors += [(g - r).abs().max() for g, r in zip(grads, ref_grads)]
        results.append((max(e.item() for e in errors), module.seen[-1], [str(w.message) for w in caught]))
    return results


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad.clone()


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_mixer_on_whole_sequences_matches_one_process():
    """Other sequence mixers under CP (:mod:`lightning_llm.parallel.cp.gathered`): outputs, input gradients and the
    parameter gradients summed over the ranks equal one process on the whole batch (float64, 1e-12); with the batch
    divisible by C each rank computes whole sequences of its own rows (batch / C), else the whole gathered batch,
    with a warning naming the module and why (its compute and activations are not divided)."""
    for rank, (_, _, mixers, *_) in enumerate(_results()):
        for (_, batch, extras), (error, seen, said) in zip(MIXER_CASES, mixers):
            assert error < 1e-12, (rank, batch, extras, error)
            split = batch % 2 == 0 and "scale" not in extras
            # Unsplit, rank 0 owns the one mixer; rank 1 runs it on 2 positions (its parameters' zero gradients).
            want = (batch // 2, 16) if split else (batch, 16) if rank == 0 else (batch, 2)
            assert seen == want, (rank, batch, extras, seen)
            warned = [w for w in said if "runs _Recurrent on the whole gathered micro-batch on one rank" in w]
            why = "does not divide by cp=2" if batch % 2 else "an input besides its (batch, sequence, ...) ones"
            assert len(warned) == (0 if split else 1) and all(why in w for w in warned), (rank, batch, extras, said)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_local_mixer_runs_on_its_own_positions_with_a_halo():
    """A mixer whose output reads only the ``w`` positions before it (:mod:`lightning_llm.parallel.cp.halo`: a short
    convolution, a token shift, position-wise layers) runs on each rank's own chunks, each after the ``w`` positions
    before it, at any batch (one row included): outputs, input gradients and the parameter gradients summed over
    the ranks equal one process (float64, 1e-12), and it computed on 16 positions plus its halos (rank 0's first
    chunk has none before it). A short convolution that also adds a position table by absolute position fails the
    probe's shifted run and runs on whole sequences, as before (by rows at batch 2, on rank 0 at batch 1); so does a
    recurrence decaying by 1e-3 a step, whose outputs do not change in float64 when an input 6 positions back does,
    but whose gradient there is not zero."""
    for rank, (*_, local, _) in enumerate(_results()):
        for (kind, batch, extras, width), (error, seen, said) in zip(LOCAL_CASES, local):
            assert error < 1e-12, (rank, kind, batch, extras, error)
            if width is not None:
                want = (batch, 16 + width * (1 if rank == 0 else 2))
            else:
                want = (1, 32) if batch == 2 else (1, 32) if rank == 0 else (1, 2)
            assert seen == want, (rank, kind, batch, seen, want)
            assert any("on one rank" in w for w in said) == (width is None and batch == 1), (rank, kind, said)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_sequence_shorter_than_the_halo_runs_whole():
    """A module given a halo of 2 at its first call, later called with chunks of 1 position, runs that call on the
    whole sequence instead (rank 0 owns it at batch 1, rank 1 runs 2 stand-in positions), exact against one process
    (float64, 1e-12); a halo longer than a chunk would have sliced past the chunk's start."""
    for rank, result in enumerate(_results()):
        error, seen = result[-1]
        assert error < 1e-12, (rank, error)
        assert seen == ((1, 4) if rank == 0 else (1, 2)), (rank, seen)
