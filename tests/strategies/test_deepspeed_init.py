"""LLMDeepSpeedStrategy ZeRO 3: a model built in configure_model is built on meta, partitioned (each rank allocating
only its partitions) and then initialized by its own init, bit for bit as in one process with the same seed.

Oracle: the model's own init (``Llama.reset_parameters``, Hugging Face's ``init_weights``) run on the whole model in
this process after ``torch.manual_seed`` (the functions of tests/parallel/test_materialize.py, which LLMParallelStrategy
also matches). Before the fix, zero.Init partitioned the children before the root init ran, which then did nothing:
the weights were torch's per-layer defaults (embedding std 1.0, Linear ~0.072 instead of 0.02).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_llm.testing import cpu_trainer, run_distributed
from tests._optional import requires_deepspeed
from tests.parallel._init_layouts import CONFIG, SEED, TIED, build
from tests.parallel.test_materialize import single_process_hf, single_process_reference

# Stage 3 keeps parameters under this many elements whole on each rank; 0 partitions every one of the tiny model's.
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
# "meta": built on the meta device, then partitioned (the default); "zero.Init": DeepSpeed's module-by-module
# construction, which the strategy keeps for NVMe parameter offload, hpZ and quantized weights (forced here).
CASES = [
    ("reference", SHARD_ALL, "meta"),
    ("tied", SHARD_ALL, "meta"),
    ("hf_llama", SHARD_ALL, "meta"),
    ("reference", None, "meta"),
    ("tied", SHARD_ALL, "zero.Init"),
]


class _Capture(L.Callback):
    """The whole parameters as setup left them (gathered), whether each was partitioned, and the tie."""

    def on_fit_start(self, trainer, pl_module) -> None:
        import deepspeed

        params = list(pl_module.parameters())
        self.partitioned = {n: p.data.numel() == 0 and p.ds_numel > 0 for n, p in pl_module.named_parameters()}
        with deepspeed.zero.GatheredParameters(params):
            self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        model = pl_module.model
        self.tied = model.output.weight is model.tok_embeddings.weight if hasattr(model, "output") else None


def _init_under_zero3(cases) -> list[dict]:
    import lightning_llm.parallel.init.materialize as materialize
    import lightning_llm.parallel.init.zero3_init as zero3_init

    zero3_init.LIVE_BYTES = 1  # one parameter gathered at a time: every release and re-gather path runs
    # Random fills drawn into the partitions in chunks of 48 elements, so chunk and partition boundaries fall inside
    # every weight (48 is a multiple of normal_'s 16-value blocks; the real chunk is 16 MiB).
    materialize._CHUNK_ELEMENTS = 48
    results = []
    import lightning_llm.strategies.deepspeed as ds_strategy

    directly = ds_strategy.partitions_directly
    for arch, config, construction in cases:
        ds_strategy.partitions_directly = directly if construction == "meta" else (lambda init: "forced by the test")
        torch.manual_seed(SEED)
        capture = _build_under_zero3(build(arch), config)
        results.append({"params": capture.params, "partitioned": capture.partitioned, "tied": capture.tied})
    return results


@pytest.fixture(scope="module")
def zero3():
    rank0, rank1 = run_distributed(_init_under_zero3, 2, CASES, timeout=300)
    return rank0, rank1


@requires_deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=[f"{a}-{'shard_all' if c else 'default'}-{m}" for a, c, m in CASES]
)
def test_zero3_init_is_bit_identical_to_single_process(zero3, case):
    arch, config, _ = CASES[case]
    expected = {
        "reference": lambda: single_process_reference(CONFIG),
        "tied": lambda: single_process_reference(TIED),
        "hf_llama": single_process_hf,
    }[arch]()
    for rank, result in enumerate(zero3):
        got = result[case]
        assert set(got["params"]) == set(expected) - ({"model.output.weight"} if arch == "tied" else set())
        for name, value in got["params"].items():
            assert torch.equal(value, expected[name]), (
                f"rank {rank} {arch}: {name} differs from the single-process init"
            )
        if config is SHARD_ALL:  # never whole on a rank: each holds only its partition of every parameter
            assert all(got["partitioned"].values()), got["partitioned"]
        if arch == "tied":
            assert got["tied"] is True, "tied embeddings came back untied"
    # The recipe, not torch's per-layer defaults (embedding std 1.0), which zero.Init left before the fix.
    if arch != "hf_llama":
        assert zero3[0][case]["params"]["model.tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)


def _unseeded_zero3() -> dict:
    import os

    torch.manual_seed(100 + int(os.environ["RANK"]))  # each rank differs on purpose: the ranks agree on rank 0's seed
    capture = _build_under_zero3(build("reference"), SHARD_ALL)
    return {"params": capture.params, "seed": int(os.environ["PL_GLOBAL_SEED"])}


@requires_deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_zero3_ranks_seeded_differently_init_from_rank_zeros_seed():
    from lightning_llm.models.llama import Llama

    rank0, rank1 = run_distributed(_unseeded_zero3, 2, timeout=300)
    assert rank0["seed"] == rank1["seed"]
    with torch.device("meta"):  # the oracle: the model's own init in one process, seeded with the agreed seed
        model = Llama(CONFIG)
    model.to_empty(device="cpu")
    torch.manual_seed(rank0["seed"])
    with torch.no_grad():
        model.reset_parameters()
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    for result in (rank0, rank1):
        assert set(result["params"]) == set(expected)
        for name, value in result["params"].items():
            assert torch.equal(value, expected[name]), name


def _build_under_zero3(module, config) -> _Capture:
    """Build ``module`` under LLMDeepSpeedStrategy ZeRO 3 on this rank (``max_steps=0``); what its init produced."""
    from lightning_llm.data import LLMDataModule
    from lightning_llm.strategies import LLMDeepSpeedStrategy

    capture = _Capture()
    trainer = cpu_trainer(
        devices=2,
        strategy=LLMDeepSpeedStrategy(zero_stage=3, config=config),
        max_steps=0,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[capture],
    )
    trainer.fit(module, LLMDataModule(num_tokens=4000, seq_len=16, batch_size=4, seed=0))
    return capture
