"""Pipeline parallelism trains exactly like a single process: every schedule, with TP and ZeRO, three models.

Models have 4 blocks so interleaved schedules get 2 stages per rank. fp32; per-step losses and each
parameter within 1e-5 relative error after 10 steps with gradient clipping at 0.5 (the global norm
spans both stages; GPT-2's tied embedding lives on the first and last stage and must be counted once).
"""

import lightning as L
import pytest
import torch

from lightning_llm._compat.versions import torch_at_least
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
from tests.strategies._parity import STEPS, assert_parity, data, make_model, train, train_layouts

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

ARCHS = ["reference", "hf_llama", "hf_gpt2"]
PP2 = {
    "pp2-gpipe": {"pipeline_parallel_size": 2, "pipeline_schedule": "GPipe", "num_microbatches": 4},
    "pp2-1f1b": {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B", "num_microbatches": 4},
    "pp2-interleaved1f1b-v2": {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "Interleaved1F1B",
        "num_microbatches": 4,
        "virtual_stages": 2,
    },
    "pp2-interleaved-zero-bubble": {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "InterleavedZeroBubble",
        "num_microbatches": 4,
    },
}
if torch_at_least("2.13"):  # refused on older torch, naming the version (tests/parallel/test_pipeline_split.py)
    PP2["pp2-zbv-zero-bubble"] = {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "ZBVZeroBubble",
        "num_microbatches": 4,
    }
PP2_X2 = {
    "pp2xtp2-sp": {
        "pipeline_parallel_size": 2,
        "tensor_parallel_size": 2,
        "sequence_parallel": True,
        "num_microbatches": 4,
    },
    "pp2xdp2-zero3": {"pipeline_parallel_size": 2, "zero_stage": 3, "num_microbatches": 4},
}
_single: dict = {}


def _reference(arch, **kwargs):
    key = (arch, tuple(sorted(kwargs.items())))
    if key not in _single:
        _single[key] = train(arch, layers=4, **kwargs)
    return _single[key]


def _layouts_for(arch, layouts):
    if arch == "hf_gpt2":  # GPT-2's fused Conv1D attention cannot be tensor-parallel
        return {k: v for k, v in layouts.items() if "tensor_parallel_size" not in v}
    return layouts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("world_size, layouts", [(2, PP2), (4, PP2_X2)], ids=["2ranks", "4ranks"])
def test_pipeline_layouts_match_single_process(arch, world_size, layouts):
    layouts = _layouts_for(arch, layouts)
    results = run_distributed(
        train_layouts, world_size, arch, list(layouts.values()), world_size, layers=4, timeout=840
    )[0]
    for label, result in zip(layouts, results):
        assert_parity(result, _reference(arch), f"{arch} {label}")


def _accumulate_and_validate(world_size):
    strategy = LLMParallelStrategy(pipeline_parallel_size=2, num_microbatches=2)
    accumulated = train("hf_llama", strategy, devices=world_size, accumulate=2, layers=4)
    model = make_model("hf_llama", layers=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=3,
        strategy=LLMParallelStrategy(pipeline_parallel_size=2, num_microbatches=4),
    )
    return accumulated, trainer.validate(model, data(4), verbose=False)[0]["val_loss"]


def test_accumulation_and_validation_through_the_pipeline():
    accumulated, val_loss = run_distributed(_accumulate_and_validate, 2, 2, timeout=300)[0]
    assert_parity(accumulated, _reference("hf_llama", accumulate=2), "pp2 with accumulate_grad_batches=2")
    single = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=3
    ).validate(make_model("hf_llama", layers=4), data(4), verbose=False)[0]["val_loss"]
    assert val_loss == pytest.approx(single, rel=1e-6)


def _resume(world_size, root, first_layout, second_layout):
    def dp(layout):
        return world_size // layout.get("pipeline_parallel_size", 1)

    first = train(
        "reference",
        LLMParallelStrategy(**first_layout),
        devices=world_size,
        dp=dp(first_layout),
        steps=STEPS // 2,
        save_to=f"{root}/half.ckpt",
        layers=4,
    )
    second = train(
        "reference",
        LLMParallelStrategy(**second_layout),
        devices=world_size,
        dp=dp(second_layout),
        resume_from=f"{root}/half.ckpt",
        layers=4,
    )
    return first[0] + second[0], second[1]


@pytest.mark.parametrize(
    "first, second",
    [
        ({"pipeline_parallel_size": 2, "num_microbatches": 2}, {"zero_stage": 0, "data_parallel_size": 2}),
        ({"zero_stage": 0, "data_parallel_size": 2}, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
    ],
    ids=["pp2-to-pp1", "pp1-to-pp2"],
)
def test_checkpoints_move_between_pipeline_layouts(tmp_path, first, second):
    # pp1 on 2 ranks is data parallel 2 with the same global batch: both halves see the same data.
    losses, params = run_distributed(_resume, 2, 2, str(tmp_path), first, second, timeout=300)[0]
    assert_parity((losses, params), _reference("reference"), "resume across pipeline layouts")


def _bad_pipeline(world_size):
    errors = []
    cases = [
        (
            {"pipeline_parallel_size": 2, "virtual_stages": 2, "pipeline_schedule": "Interleaved1F1B"},
            2,
            4,
        ),  # 4 stages, 2 blocks
        ({"pipeline_parallel_size": 2, "num_microbatches": 3}, 4, 4),  # batch 4 per rank
        ({"pipeline_parallel_size": 2, "pipeline_split": [["model.layers.0"], ["model.layers.9"]]}, 2, 4),
    ]
    for kwargs, layers, batch in cases:
        model = make_model("reference", layers)
        model.steps_run = 0
        trainer = cpu_trainer(
            devices=world_size,
            strategy=LLMParallelStrategy(**kwargs),
            max_steps=1,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        try:
            trainer.fit(model, data(batch))
            errors.append(None)
        except ValueError as err:
            errors.append((str(err), trainer.global_step))
    return errors


def test_bad_pipeline_settings_are_refused_before_the_first_step():
    errors = run_distributed(_bad_pipeline, 2, 2, timeout=300)[0]
    expected = [
        "4 pipeline stages need at least as many transformer blocks, but the model has 2",
        "not divisible by num_microbatches=3",
        "pipeline_split stage 1 names ['model.layers.9'], which match no block",
    ]
    for error, fragment in zip(errors, expected):
        assert error is not None and fragment in error[0], error
        assert error[1] == 0, "no optimizer step may run before the error"


def test_argument_errors_name_the_fix():
    with pytest.raises(ValueError, match="num_microbatches=1 is fewer than pipeline_parallel_size=2"):
        LLMParallelStrategy(pipeline_parallel_size=2, num_microbatches=1)
    with pytest.raises(ValueError, match="pipeline_schedule='Zigzag' is unknown"):
        LLMParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="Zigzag")
    with pytest.raises(ValueError, match="runs one stage per rank, but virtual_stages=2"):
        LLMParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="1F1B", virtual_stages=2)


class _AllReduces(L.Callback):
    """Counts the all-reduces (``c10d::allreduce_``, what ZeRO 0's gradient reduction runs) of the second optimizer
    step, all its batches."""

    def __init__(self) -> None:
        self.count, self.profile = 0, None

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == 1 and self.profile is None:
            self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profile.__enter__()

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == 2 and self.profile is not None and not self.count:
            self.profile.__exit__(None, None, None)
            self.count = sum(event.name == "c10d::allreduce_" for event in self.profile.events())


def _zero0_pipelines(world_size):
    results = {}
    for label, layout, accumulate in ZERO0_X_PP2:
        counter = _AllReduces()
        strategy = LLMParallelStrategy(pipeline_parallel_size=2, zero_stage=0, **layout)
        got = train("reference", strategy, world_size, dp=2, accumulate=accumulate, layers=4, callbacks=[counter])
        results[label] = (got, counter.count)
    return results


ZERO0_X_PP2 = [
    ("1F1B x 2", {"num_microbatches": 2}, 1),
    ("1F1B x 4", {"num_microbatches": 4}, 1),
    ("Interleaved1F1B v2 x 4", {"pipeline_schedule": "Interleaved1F1B", "virtual_stages": 2, "num_microbatches": 4}, 1),
    ("1F1B x 2, accumulate 2", {"num_microbatches": 2}, 2),
]


def test_zero0_under_a_pipeline_reduces_once_per_step_and_trains_like_one_process():
    """pp2 x dp2 at ZeRO 0: the schedule's micro-batches before the last do not all-reduce (as Lightning's own
    accumulation does not), so a step all-reduces as often at 4 micro-batches as at 2, with two stages per rank
    (each unit reduced at the last micro-batch of the lowest stage holding it), and over two accumulated batches:
    once per FSDP unit, besides the clipping norm's and the recording callback's loss (per batch). Before: once per
    unit and micro-batch (8, 14, 14 and 9 all-reduces; now 5, 5, 5 and 6). What is reduced is every micro-batch's
    gradient: parity with one process in each case."""
    per_rank = run_distributed(_zero0_pipelines, 4, 4, timeout=600)
    for rank in per_rank:
        counts = {label: result[1] for label, result in rank.items()}
        # besides the gradients': the clipping norm's per step, the recorded loss's per batch (accumulation: two)
        assert counts["1F1B x 4"] == counts["1F1B x 2"] == counts["Interleaved1F1B v2 x 4"], counts
        assert counts["1F1B x 2, accumulate 2"] == counts["1F1B x 2"] + 1, counts
    for label, _, accumulate in ZERO0_X_PP2:
        want = _reference("reference", accumulate=accumulate) if accumulate > 1 else _reference("reference")
        assert_parity(per_rank[0][label][0], want, f"pp2 x dp2 ZeRO 0 {label}")
