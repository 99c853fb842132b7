"""Context parallelism against one process: HF Llama, a partial-rotary HF model (GPT-NeoX, rotary_pct=0.5) and the
reference model, fp32, 10 steps: per-step loss and every parameter within 1e-5 relative of one process, parameters
bit-identical on every rank that holds them, and each rank's attention kernel computing exactly its own zig-zag
queries (Ulysses: every position, for half the heads). Attention masked by global position too: Mistral's sliding
window and the reference model on packed documents (document ids from a token file); latent attention with value
heads narrower than query/key heads (DeepSeek-V3's MLA) by ring and Ulysses; hybrid stacks whose Mamba-2 and gated
delta-net mixers run on the gathered sequence (Falcon-H1, Bamba, Qwen3-Next, Jamba) and LFM2, whose short
convolution runs on each rank's own positions with a halo; litgpt's Llama, which takes no
position_ids and slices its cached rotary table as ``cos[:T]`` (made global); zero_stage="auto" under cp2
plans with half the activations per rank. Layouts: on 2 ranks cp2 (ZeRO 0, replicated over the CP ranks), cp2 +
ZeRO-3 (FSDP over ``dp_shard_cp`` = 2), Ulysses cp2 + ZeRO-3, cp2 + ZeRO-3 + selective activation checkpointing,
cp2 + "auto"; on 4 ranks cp2 × tp2 (+ ZeRO-3 over the CP ranks), cp2 × tp2 + sequence parallelism (the sequence
split by CP, each shard split again by SP between attention blocks), cp2 × pp2 (CP-local hidden states between
the stages) and dp2 × cp2 (ZeRO-3 over ``dp_shard_cp`` = 4).

One spawned process group trains every case (starting the ranks costs more than the tiny models).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightning_llm.data import LLMDataModule
from lightning_llm.data.token_files import TokenFileInfo, offsets_path, write_token_info
from lightning_llm.parallel.cp import count_queries, zigzag_positions
from lightning_llm.strategies.zero_auto import model_footprint
from lightning_llm.testing import run_distributed
from tests.strategies import _parity
from tests.strategies._parity import assert_parity
from tests.zoo import _harness, _models_attention, _models_hybrid, _models_more  # noqa: F401 (registers the attention variants' models)
from tests.zoo._models import _DENSE, BUILDERS, ZooLM, _hf

_models_hybrid.register()
_models_more.register()

pytestmark = [pytest.mark.distributed]

LAYOUTS = {
    "cp2": (2, {"context_parallel_size": 2, "zero_stage": 0}),
    "cp2_zero3": (2, {"context_parallel_size": 2}),
    "cp2_ulysses_zero3": (2, {"context_parallel_size": 2, "context_parallel_method": "ulysses"}),
    "cp2_zero3_ac": (2, {"context_parallel_size": 2, "activation_checkpointing": "selective"}),  # recompute rings too
    # zero_stage="auto" plans with each rank's 1/C of the activations; 80 GB fits ZeRO 0 (least communication)
    "cp2_auto": (2, {"context_parallel_size": 2, "zero_stage": "auto", "device_memory": "80GB"}),
    "cp2_tp2": (4, {"context_parallel_size": 2, "tensor_parallel_size": 2}),  # ZeRO-3 over dp_shard_cp = 2 too
    "cp2_tp2_sp": (4, {"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}),
    "cp2_pp2": (4, {"context_parallel_size": 2, "pipeline_parallel_size": 2}),  # ZeRO-3 over each stage's CP pair
    "dp2_cp2_zero3": (4, {"context_parallel_size": 2}),  # 2 data-parallel replicas, FSDP over dp_shard_cp = 4
    # Micro-batches of one sequence (4 accumulated per step): a hybrid's mixers run whole on one rank each in turn.
    "cp2_mb1": (2, {"context_parallel_size": 2, "zero_stage": 0}),
    "cp2_zero3_mb1": (2, {"context_parallel_size": 2}),
    "cp2_zero3_full_ac_mb1": (2, {"context_parallel_size": 2, "activation_checkpointing": "full"}),
    "cp2_tp2_sp_mb1": (4, {"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}),
}
_harness.ACCUMULATE.update({"cp2_mb1": 4, "cp2_zero3_mb1": 4, "cp2_zero3_full_ac_mb1": 4, "cp2_tp2_sp_mb1": 4})
MODELS = ["llama", "gpt_neox", "reference"]
# Attention with a mask by global position, on the 2-rank layouts with one data-parallel rank: Mistral's sliding
# window (8 of the zoo's 16 tokens) and the reference model on packed documents (document_ids from a token file).
MASKED = {"mistral": ["cp2_zero3", "cp2_ulysses_zero3"], "reference_documents": ["cp2", "cp2_ulysses_zero3"]}
# Latent attention (DeepSeek-V3's MLA): value heads (16) narrower than query/key heads (20), by ring and by Ulysses.
LATENT = {"deepseek_v3_mla": ["cp2", "cp2_ulysses_zero3"]}
# Hybrid stacks: their Mamba-2 / gated delta-net mixers run on the gathered sequence, attention by the ring or
# Ulysses. Falcon-H1 (Mamba-2 beside attention in every block), Bamba (Mamba-2 layers between attention layers),
# Qwen3-Next (gated delta-net layers, MoE) and Jamba (Mamba layers, MoE).
HYBRID = {
    "falcon_h1": [
        "cp2",
        "cp2_ulysses_zero3",
        "cp2_tp2_sp",
        "cp2_zero3_mb1",
        "cp2_tp2_sp_mb1",
    ],  # SP: the mixer's input is a DTensor
    "bamba": ["cp2_zero3", "cp2_pp2", "cp2_zero3_full_ac_mb1"],
    "qwen3_next": ["cp2_ulysses_zero3", "cp2_mb1"],
    "jamba": ["cp2_zero3_ac"],
    "lfm2": ["cp2_zero3_mb1", "cp2_zero3_ac"],  # its short convolution reads 2 positions back: run with a halo
}
# LFM2: a gated short convolution (kernel 3) in its first layer, attention in its second.
BUILDERS["lfm2"] = lambda: _hf("Lfm2Config", "Lfm2ForCausalLM", **_DENSE, layer_types=["conv", "full_attention"])
# Positions computed inside the forward (no position_ids): litgpt slices its cached rotary table as cos[:T].
POSITIONS = {"litgpt_llama": ["cp2", "cp2_ulysses_zero3"]}
ONE_MODEL = {
    "cp2_auto": ["llama"],
    "cp2_tp2_sp": ["llama", "reference"],
    "cp2_pp2": ["llama", "reference"],
    "cp2_mb1": [],
    "cp2_zero3_mb1": [],
    "cp2_zero3_full_ac_mb1": [],
    "cp2_tp2_sp_mb1": [],
}  # layouts trained on fewer models (the micro-batch-1 ones on hybrids only)
CASES = [(layout, name) for layout in LAYOUTS for name in ONE_MODEL.get(layout, MODELS)]
CASES += [(layout, name) for name, layouts in {**MASKED, **LATENT, **HYBRID, **POSITIONS}.items() for layout in layouts]
STEPS = _parity.STEPS  # 10 optimizer steps for every model (the zoo's default is 4)
REFERENCE_SEQ = 32  # the reference model reads seq_len + 1 tokens and trains on 32; the zoo trains on 16


def _differing(model) -> list[str]:
    state = _harness._local_state(model)
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return sorted(k for k, v in state.items() if any(k in s and not torch.equal(s[k], v) for s in states))


def _packed_documents(root: Path) -> LLMDataModule:
    """Token ids with documents of 2 to 20 tokens (a token file, its offsets and sidecar, as ``prepare`` writes)."""
    path = root / "train.bin"
    if not path.exists():
        gen = np.random.default_rng(0)
        lengths = gen.integers(2, 21, size=800)
        np.asarray(gen.integers(1, 256, size=int(lengths.sum())), dtype=np.uint16).tofile(path)
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64).tofile(offsets_path(path))
        write_token_info(path, TokenFileInfo("uint16", 256, 0, None, len(lengths), int(lengths.sum())))
    return LLMDataModule(
        source="tokens", path=str(path), seq_len=REFERENCE_SEQ, batch_size=_parity.GLOBAL_BATCH,
        return_document_ids=True, seed=3,
    )  # fmt: skip


def _train(name: str, layout: str | None, root: Path):
    from lightning_llm.strategies import LLMParallelStrategy

    devices, kwargs = LAYOUTS[layout] if layout else (1, {"context_parallel_size": 1})
    model_parallel = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
    dp = devices // kwargs["context_parallel_size"] // model_parallel
    strategy = LLMParallelStrategy(**kwargs) if layout else None
    if not name.startswith("reference"):
        accumulate = _harness.ACCUMULATE.get(layout, 1)
        losses, params, differing, planned, _ = _harness.train(
            name, strategy, devices=devices, dp=dp, steps=STEPS, accumulate=accumulate
        )
        if planned is not None:  # zero_stage="auto": the stage chosen and the activations it planned per rank
            planned = (strategy.decision.stage, planned)
        return losses, params, differing, planned
    model = _parity.make_model("reference")
    data = _packed_documents(root) if name == "reference_documents" else None
    losses, params = _parity.train("reference", strategy, devices=devices, dp=dp, model=model, datamodule=data)
    return losses, params, _differing(model) if layout else [], None


def _cp_cases(cases: list[tuple[str, str]], root: Path) -> dict:
    """On each rank: {(layout, model): (losses, params, differing, query positions the kernel saw)}."""
    results, said = {}, _Lines()
    logging.getLogger("lightning_llm.parallel.cp.halo").addHandler(said)
    logging.getLogger("lightning_llm.parallel.cp.halo").setLevel(logging.INFO)
    for layout, name in cases:
        seen: list[int] = []
        said.lines.clear()
        with count_queries(lambda positions, keys: seen.extend(positions.tolist())):
            result = _train(name, layout, root)
        results[(layout, name)] = (*result, sorted(set(seen)), [line for line in said.lines if "halo" in line])
    return results


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


_runs: dict = {}
_ROOT = Path(tempfile.mkdtemp(prefix="cp_documents_"))


def _results(world_size: int) -> list[dict]:
    if world_size not in _runs:
        cases = [case for case in CASES if LAYOUTS[case[0]][0] == world_size]
        _runs[world_size] = run_distributed(_cp_cases, world_size, cases, _ROOT, timeout=840)
    return _runs[world_size]


def _reference(name: str):
    if name.startswith("reference"):
        return _train(name, None, _ROOT)[:2]
    return _harness.train(name, steps=STEPS)[:2]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("layout", "name"), CASES)
def test_context_parallel_matches_single_process(layout, name):
    ranks = _results(LAYOUTS[layout][0])
    losses, params, differing, planned, _, halos = ranks[0][(layout, name)]
    # LFM2's short convolution runs on each rank's own positions with a halo of 2 (not on whole sequences)
    lfm2 = [line for line in halos if "Lfm2ShortConv reads 2 position(s) back" in line and line.endswith("halo of 2")]
    assert len(lfm2) == len(halos) == (name == "lfm2"), halos
    ref_losses, ref_params = _reference(name)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_error = max(((params[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref_params.items())
    print(f"{name} {layout}: max loss rel diff {loss_error:.1e}, max param rel diff {param_error:.1e}")
    assert not differing, f"{name} {layout}: replicated parameters differ between the CP ranks: {differing}"
    assert_parity((losses, params), (ref_losses, ref_params), f"{name} {layout}", rtol=1e-5)
    if layout == "cp2_auto":  # ZeRO 0 chosen, from each rank's half of the whole sequence's activations
        whole = model_footprint(ZooLM(name), micro_batch_size=_harness.GLOBAL_BATCH, seq_len=_harness.SEQ_LEN)
        # and the ring's backward buffers for one attention call, by hand: fp32 queries (batch 4, 4 heads, the
        # planning batch's 17 tokens, which this model's forward takes whole, head dim 8) and keys (2 key/value
        # heads, which the CPU kernel takes grouped, never repeated): (1.5 q + 4 k + k) / 2.
        q, k = 4 * 4 * 17 * 8 * 4, 4 * 2 * 17 * 8 * 4
        ring = (1.5 * q + 4 * k + k) / 2
        assert planned == (0, pytest.approx(whole.activations / 2 + ring)), (planned, whole.activations)
    seq = REFERENCE_SEQ if name.startswith("reference") else _harness.SEQ_LEN
    tp = LAYOUTS[layout][1].get("tensor_parallel_size", 1)
    for rank, results in enumerate(ranks):  # each rank's kernel saw exactly its own shard's queries (cp rank below)
        seen = results[(layout, name)][4]
        if not seen and name in HYBRID and "pipeline_parallel_size" in LAYOUTS[layout][1]:
            continue  # this rank's pipeline stage holds Mamba layers only: no attention kernel to check
        # Ulysses: all positions, heads / 2 heads; masked attention takes the all-gather path whatever the method
        ulysses = LAYOUTS[layout][1].get("context_parallel_method") == "ulysses" and name not in MASKED
        cp_rank = rank // tp % 2  # mesh (pp, dp_shard, cp, tp), tp innermost
        assert seen == (list(range(seq)) if ulysses else zigzag_positions(seq, 2, cp_rank).tolist()), (rank, seen)
