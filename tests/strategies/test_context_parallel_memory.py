"""Context parallelism's memory: per-rank activation bytes of an 8K-token sequence fall to about 1/C at C = 2 and 4;
a hybrid model's plan counts its Mamba-2 mixers whole where CP runs them whole.

Oracle: torch's own memory tracker (``torch.distributed._tools.mem_tracker.MemTracker``) around one forward and
loss of the reference model (4 blocks, dim 128, vocabulary 64 so that the gathered logits are a small part), on 4
gloo ranks laid out as dp4 (C = 1: every rank holds a whole sequence), dp2 × cp2 and cp4; every rank holds one
sequence of 8192 tokens or its 1/C share. The peak of the bytes that are neither parameters nor buffers is what a
rank needs for activations; parameters are replicated (ZeRO 0), so they are the same in every layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_llm.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SEQ = 8192
LAYOUTS = {1: "dp4", 2: "dp2 x cp2", 4: "cp4"}


def _peak_activation_bytes(cp: int) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    from lightning_llm.models import CausalLM, LlamaConfig
    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize

    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny", vocab_size=64, dim=128, n_layers=4, ffn_hidden_dim=384, max_seq_len=SEQ)
    module = CausalLM(config)
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    dims = ParallelDims.for_world(dist.get_world_size(), cp=cp, replicate_all=True)
    dims.build_mesh("cpu")
    parallelize(module, dims, zero_stage=0)
    tokens = torch.randint(0, 64, (1, SEQ + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        loss = module.training_step(tokens, 0)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    del loss
    held = {str(kind).split(".")[-1]: nbytes for kind, nbytes in peak.items()}
    return held["Total"] - held["PARAM"] - held["BUFFER"]


def _every_layout() -> dict[int, int]:
    dist.init_process_group("gloo")
    return {cp: _peak_activation_bytes(cp) for cp in LAYOUTS}


@pytest.mark.timeout(600)
def test_activation_bytes_per_rank_fall_to_about_one_over_c():
    ranks = run_distributed(_every_layout, 4, timeout=540)
    for cp, layout in LAYOUTS.items():
        print(f"{layout}: peak activation bytes per rank {[r[cp] / 2**20 for r in ranks]} MiB")
    for per_rank in ranks:
        whole = per_rank[1]
        assert whole > 50 * 2**20, "the 8K-token forward must hold tens of MiB of activations at C = 1"
        for cp in (2, 4):
            # Measured 356 -> 195 -> 104 MiB (0.55, 0.29): the blocks' activations split C ways; what stays whole on
            # every rank (the gathered hidden states, the loss and the gradients its chunked cross-entropy computes
            # in the forward, the embedding's input) is the few percent above 1/C. (With whole logits and their
            # gradients left to the backward: 354 -> 190 -> 98 MiB.)
            assert 1 / cp - 0.01 < per_rank[cp] / whole < 1 / cp + 0.06, (cp, per_rank)


HYBRID_SEQ = 1024


class _Hybrid(torch.nn.Module):
    """Hugging Face's Bamba: Mamba-2 layers (8 heads of 32 channels) with attention layers between; hidden 128."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BambaConfig, BambaForCausalLM

        config = BambaConfig(
            vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4, attn_layer_indices=[1, 3],
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2,
            mamba_d_state=16, mamba_chunk_size=256, max_position_embeddings=HYBRID_SEQ,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = BambaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _step_peak_bytes(module: torch.nn.Module, tokens: torch.Tensor, cp: int, method: str = "ring") -> int:
    """Peak bytes (not parameters, buffers or gradients) of a forward, loss and backward of ``module`` on this rank,
    laid out under ``cp`` (1: as it is)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from lightning_llm.modeling.structure import traced_blocks
    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize

    if cp > 1:
        traced = traced_blocks(module, lambda move: module.training_step(move(tokens), 0))
        dims = ParallelDims.for_world(dist.get_world_size(), cp=cp, replicate_all=True)
        dims.build_mesh("cpu")
        parallelize(
            module, dims, zero_stage=0, blocks=traced.override(module), traced=traced, context_parallel_method=method
        )
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        module.training_step(tokens, 0).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    held = {str(kind).split(".")[-1]: nbytes for kind, nbytes in peak.items()}
    return held["Total"] - sum(held.get(kind, 0) for kind in ("PARAM", "BUFFER", "GRAD"))


def _hybrid_peak_bytes(cp: int, micro_batch: int) -> int:
    tokens = torch.randint(0, 64, (micro_batch, HYBRID_SEQ + 1), generator=torch.Generator().manual_seed(0))
    return _step_peak_bytes(_Hybrid(), tokens, cp)


def _hybrid_layouts() -> dict:
    dist.init_process_group("gloo")
    return {(cp, b): _hybrid_peak_bytes(cp, b) for cp in (1, 2) for b in (1, 2)}


@pytest.mark.timeout(300)
def test_a_hybrids_planned_activations_per_rank_match_the_measured_under_cp():
    """Mamba-2 mixers, and the Mamba-only block around one (it runs no attention), run on whole sequences under CP:
    by batch rows with a micro-batch of 2, on one rank each in turn with a micro-batch of 1 (layer 0's on rank 0,
    layer 2's on rank 1). The plan (``model_footprint(cp=...)`` on fake tensors, divided by C as the planner
    divides; the largest rank's) against torch's MemTracker on 2 gloo ranks: within 5%, and with a micro-batch of 1
    at cp2 within 15% (the owner's backward through its whole-sequence mixer allocates temporaries the plan does
    not count). Each rank keeps under 0.65 of one process's activations at a micro-batch of 1 (measured 0.57 and
    0.59, planned 0.51), where all-gathered mixers kept 0.88."""
    from lightning_llm.strategies.zero_auto import model_footprint

    ranks = run_distributed(_hybrid_layouts, 2, timeout=280)
    errors = {}
    for cp, micro_batch in ranks[0]:
        planned = model_footprint(_Hybrid(), micro_batch_size=micro_batch, seq_len=HYBRID_SEQ, cp=cp).activations / cp
        largest = max(r[(cp, micro_batch)] for r in ranks)
        errors[(cp, micro_batch)] = planned / largest - 1
        print(f"cp {cp}, micro-batch {micro_batch}: planned {planned / 2**20:.1f} MiB, measured "
              f"{[round(r[(cp, micro_batch)] / 2**20, 1) for r in ranks]} MiB per rank")  # fmt: skip
    for (cp, micro_batch), error in errors.items():
        assert abs(error) < (0.15 if (cp, micro_batch) == (2, 1) else 0.05), (cp, micro_batch, error)
    for rank in ranks:
        assert rank[(2, 1)] / rank[(1, 1)] < 0.65, rank


WINDOW_SEQ, WINDOW = 1024, 256


class _Windowed(torch.nn.Module):
    """Hugging Face's Mistral, 2 layers, hidden 128, 4 query and 2 key/value heads; a sliding window or none."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        from transformers import MistralConfig, MistralForCausalLM

        config = MistralConfig(
            vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=WINDOW_SEQ, sliding_window=window,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = MistralForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


WINDOW_CASES = [(w, b, "ring") for w in (None, WINDOW) for b in (1, 2)] + [(None, b, "ulysses") for b in (1, 2)]


def _windowed_peak_bytes(window: int | None, micro_batch: int, method: str) -> int:
    tokens = torch.randint(0, 64, (micro_batch, WINDOW_SEQ + 1), generator=torch.Generator().manual_seed(0))
    return _step_peak_bytes(_Windowed(window), tokens, 2, method)


def _packed() -> torch.nn.Module:
    """The reference model (2 blocks, dim 128, 4 query and 2 key/value heads) for packed documents."""
    from lightning_llm.models import CausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig.from_name(
        "tiny", vocab_size=64, dim=128, n_layers=2, ffn_hidden_dim=256, max_seq_len=WINDOW_SEQ
    )
    module = CausalLM(config)
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    return module


def _packed_batch() -> dict:
    tokens = torch.randint(0, 64, (1, WINDOW_SEQ + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens, "document_ids": (torch.arange(WINDOW_SEQ + 1) // 300)[None]}  # 4 documents


def _windowed_layouts() -> dict:
    dist.init_process_group("gloo")
    peaks = {case: _windowed_peak_bytes(*case) for case in WINDOW_CASES}
    return peaks | {("documents", cp): _step_peak_bytes(_packed(), _packed_batch(), cp) for cp in (1, 2)}


_runs: list = []


def _windowed_runs() -> list[dict]:
    if not _runs:
        _runs.append(run_distributed(_windowed_layouts, 2, timeout=280))
    return _runs[0]


@pytest.mark.timeout(300)
def test_planned_attention_under_cp_counts_gathered_keys_chunk_masks_and_the_rings_buffers():
    """Under cp2 a sliding-window call gathers the keys and values whole and builds a mask per query chunk; a call
    without a mask runs the ring, whose backward allocates its own buffers, or Ulysses. The plan
    (``model_footprint(cp=2, context_parallel_method=...)``, divided by 2 as the planner divides) against torch's
    MemTracker on 2 gloo ranks (the larger rank). Measured here: with the window 1.03-1.05, an upper bound (the keys
    left of the window are counted; dividing one process's
    attention by 2 said 1.05-1.13: the whole-sequence mask halved, where the chunks' masks are 5/16 of it, and the
    keys and values halved, where they stay whole); the ring without it 0.96, Ulysses 0.87 (nothing added). Both
    measure the same peak here (10.80 and 10.86 MiB at micro-batch 1): the step's peak is the backward's other
    temporaries, which no plan counts (one process is 0.93 of measured), and the ring's buffers, which the plan adds
    once, stay under it; dividing by 2 said 0.87."""
    from lightning_llm.strategies.zero_auto import model_footprint

    ranks = _windowed_runs()
    for window, micro_batch, method in WINDOW_CASES:
        measured = max(rank[window, micro_batch, method] for rank in ranks)
        planned = model_footprint(
            _Windowed(window), micro_batch_size=micro_batch, seq_len=WINDOW_SEQ, cp=2, context_parallel_method=method
        )
        ratio = planned.activations / 2 / measured
        print(f"{method}, window {window}, micro-batch {micro_batch}: planned / measured {ratio:.3f}")
        if window is not None:
            assert 0.98 < ratio < 1.08, (window, micro_batch, ratio)
        elif method == "ring":
            assert 0.92 < ratio < 1.05, (micro_batch, ratio)
        else:  # as one process's plan: the backward's temporaries are not planned
            assert 0.82 < ratio < 0.95, (micro_batch, ratio)


@pytest.mark.timeout(300)
def test_packed_documents_are_planned_as_the_masked_attention_they_run():
    """A run whose batches carry packed documents' ids (``LLMDataModule(return_document_ids=True)``) masks attention
    by document, and under CP each rank gathers the keys and values whole for it. ``model_footprint(documents=True)``
    plans that forward (the reference model, 1,024 tokens in 4 documents, micro-batch 1) against MemTracker on 2
    gloo ranks, the larger rank: measured 0.94 (one process) and 0.89 (cp2, ring); the plan without the documents,
    what every run was planned as before, 0.66 and 0.72."""
    from lightning_llm.strategies.zero_auto import model_footprint

    ranks = _windowed_runs()
    for cp in (1, 2):
        measured = max(rank["documents", cp] for rank in ranks)
        planned, plain = (
            model_footprint(_packed(), micro_batch_size=1, seq_len=WINDOW_SEQ, cp=cp, documents=documents).activations
            / cp
            / measured
            for documents in (True, False)
        )
        print(f"packed documents, cp{cp}: planned / measured {planned:.3f} (without the documents {plain:.3f})")
        assert 0.85 < planned < 1.05, (cp, planned)
        assert plain < 0.8 and planned - plain > 0.15, (cp, planned, plain)
