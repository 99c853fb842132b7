"""LLMDeepSpeedStrategy: ZeRO 1/2/3 (and offload) parity with single-process training on 2 CPU ranks, resume,
"auto" through the planner, presets, the CLI and refused input.

One 2-rank job (the module fixture) trains every layout once and the tests read its results: 10 fp32
steps per layout against a single-process run of the same model, data and seed; per stage a save at
step 5 with ``trainer.save_checkpoint`` and a run resumed from it to step 10.
"""

from __future__ import annotations

import shutil
import sys
import types
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_llm.strategies.zero_auto as zero_planner
from lightning_llm.strategies.deepspeed import LLMDeepSpeedStrategy
from lightning_llm.strategies.deepspeed_config import default_config, merge_config
from lightning_llm.strategies.zero_auto import choose_zero_stage
from lightning_llm.testing import cpu_trainer, run_distributed
from tests._optional import requires_deepspeed
from tests._payload import Payload
from tests.strategies._parity import GLOBAL_BATCH, STEPS, GlobalLoss, assert_parity, data, make_model

pytestmark = requires_deepspeed  # an optional extra; tests/test_optional_dependencies.py checks the refusal without it

CONFIG = Path(__file__).parents[2] / "configs" / "tiny_deepspeed.yaml"
SAVE_STEP = 5
# Tolerance for fp32 parity, relative: per-step losses and ||p - p_ref|| / ||p_ref|| per tensor. DeepSpeed sums
# gradients of 2 ranks and computes the clipping norm from partitions, in another order than one process.
RTOL = 1e-5
# Stage 3 keeps parameters under this many elements whole on each rank; 0 makes it shard the tiny model's all.
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
PLANNER_MARGIN = 0.1  # the share of device memory LLMDeepSpeedStrategy tells the planner to keep free
LAYOUTS = {
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3, config=SHARD_ALL),
    "zero2_offload": dict(zero_stage=2, offload="optimizer"),
    "zero3_offload": dict(zero_stage=3, offload="optimizer+params", config=SHARD_ALL),
}


class SaveAt(L.Callback):
    """Calls ``trainer.save_checkpoint`` inside the loop at one step, as a periodic save in a long run does."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class StateBytes(L.Callback):
    """Bytes of this rank's parameters, gradients and optimizer state, read from the engine before the last step."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == trainer.max_steps - 1:
            self.bytes = engine_state_bytes(trainer.strategy.deepspeed_engine)


def engine_state_bytes(engine) -> dict[str, int]:
    """Storage bytes per category, each storage counted once: the model's parameters (under stage 3 the
    local partitions and any parameter kept whole), the fp32 master copies and optimizer state of the wrapped
    torch optimizer, and the gradient buffers the ZeRO optimizer holds (attributes whose name has ``grad``)."""
    seen: set[int] = set()
    total: Counter = Counter()

    def add(kind: str, tensor) -> None:
        storage = tensor.untyped_storage() if torch.is_tensor(tensor) else None
        if storage is not None and storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[kind] += storage.nbytes()

    for p in engine.module.parameters():
        add("parameters", getattr(p, "ds_tensor", None))  # a stage-3 partition
        add("parameters", p)  # whole (below stage 3, or a stage-3 parameter kept whole); empty once released
        add("gradients", p.grad)
    inner = engine.optimizer.optimizer
    for param, state in inner.state.items():
        add("master_weights", param)
        for value in state.values():
            add("optimizer_state", value if torch.is_tensor(value) and value.numel() > 1 else None)
    for name, value in vars(engine.optimizer).items():
        if "grad" in name:
            for tensor in _tensors(value):
                add("gradients", tensor)
    return dict(total)


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def full_params(module, sharded: bool) -> dict[str, torch.Tensor]:
    import deepspeed

    # Under stage 3 each rank holds a slice of every parameter; gather them to compare whole tensors.
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=sharded):
        return {name: p.detach().clone().float() for name, p in module.named_parameters()}


def fit(strategy=None, devices: int = 1, steps: int = STEPS, callbacks=(), resume_from=None):
    """Train the reference tiny Llama until ``steps``; return (global losses per step, full parameters)."""
    model = make_model("reference")
    losses = GlobalLoss()
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy or "auto",
        max_steps=steps,
        gradient_clip_val=0.5,
        callbacks=[losses, *callbacks],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data(GLOBAL_BATCH // devices), ckpt_path=resume_from)
    sharded = isinstance(strategy, LLMDeepSpeedStrategy) and strategy.zero_stage == 3
    return losses.losses, full_params(model, sharded) if strategy else full_params(model, False)


def validate(strategy=None, devices: int = 1) -> dict[str, float]:
    """``trainer.validate`` alone (DeepSpeed builds an inference engine) on the untrained model."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy or "auto",
        limit_val_batches=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(make_model("reference"), data(GLOBAL_BATCH // devices))
    return metrics


def memory_that_fits_only_zero3(micro_batch_size: int, seq_len: int) -> int:
    """Device memory between the planner's ZeRO-2 and ZeRO-3 estimates for the tiny model on 2 ranks."""
    rows = choose_zero_stage(
        make_model("reference"),
        device_memory=2**40,
        world_size=2,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        backend="deepspeed",
    ).rows
    total = {(row.zero_stage, row.offload): row.total for row in rows}
    assert total[(3, "none")] < total[(2, "none")] < total[(1, "none")]
    return int((total[(3, "none")] + total[(2, "none")]) / 2 / (1 - PLANNER_MARGIN))


def _spy_on_planner(calls: list) -> None:
    """Records what the strategy asks the (real) planner."""
    real = zero_planner.choose_zero_stage

    def choose_zero_stage(model, **kwargs):
        calls.append({"model": type(model).__name__, **kwargs})
        return real(model, **kwargs)

    zero_planner.choose_zero_stage = choose_zero_stage


def _train_all_layouts(tmp: str, auto_memory: int) -> dict:
    results = {}
    for name, kwargs in LAYOUTS.items():
        strategy, probe = LLMDeepSpeedStrategy(**kwargs), StateBytes()
        results[name] = fit(strategy, devices=2, callbacks=[probe])
        results[f"{name} bytes"], results[f"{name} config"] = probe.bytes, strategy.config
    for name in ("zero1", "zero2", "zero3"):
        checkpoint = f"{tmp}/{name}.ckpt"
        first = fit(
            LLMDeepSpeedStrategy(**LAYOUTS[name]), devices=2, steps=SAVE_STEP, callbacks=[SaveAt(SAVE_STEP, checkpoint)]
        )
        second = fit(LLMDeepSpeedStrategy(**LAYOUTS[name]), devices=2, resume_from=checkpoint)
        results[f"{name} resumed"] = (first[0] + second[0], second[1])
    results["validate"] = validate(LLMDeepSpeedStrategy(**LAYOUTS["zero3"]), devices=2)
    calls: list = []
    _spy_on_planner(calls)
    auto = LLMDeepSpeedStrategy(zero_stage="auto", offload="auto", config=SHARD_ALL, device_memory=auto_memory)
    results["auto"] = fit(auto, devices=2)
    results["auto calls"], results["auto stage"] = calls, auto.deepspeed_engine.zero_optimization_stage()
    results["auto decision"] = (auto.decision.stage, auto.decision.offload)
    results["poisoned"] = _resume_poisoned(Path(tmp))
    return results


def _resume_poisoned(tmp: Path) -> tuple[str | None, bool]:
    """Resume from a copy of the ZeRO-2 checkpoint whose rank-0 optimizer states carry a planted payload that would
    create a file if unpickled (DeepSpeed loads these files with a full unpickler): (the error, did it run?)."""
    import torch.distributed as dist

    poisoned, ran = tmp / "poisoned.ckpt", tmp / "PAYLOAD_RAN"
    if dist.get_rank() == 0:
        shutil.copytree(tmp / "zero2.ckpt", poisoned)
        (states,) = poisoned.rglob("zero_pp_rank_0_*optim_states.pt")
        state = torch.load(states, weights_only=False)  # the test's own file
        state["planted"] = Payload(ran)
        torch.save(state, states)
    dist.barrier()
    try:
        fit(LLMDeepSpeedStrategy(**LAYOUTS["zero2"]), devices=2, resume_from=str(poisoned))
    except ValueError as err:
        return str(err), ran.exists()
    return None, ran.exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed")
    reference, reference_validation = fit(), validate()
    auto_memory = memory_that_fits_only_zero3(GLOBAL_BATCH // 2, data(1).hparams.seq_len)
    rank0, rank1 = run_distributed(_train_all_layouts, 2, str(tmp), auto_memory, timeout=280)
    return types.SimpleNamespace(
        reference=reference, reference_validation=reference_validation, ranks=(rank0, rank1), auto_memory=auto_memory
    )


@pytest.mark.distributed
def test_resume_refuses_a_payload_planted_in_a_deepspeed_file_before_deepspeed_unpickles_it(runs):
    for message, ran in (rank["poisoned"] for rank in runs.ranks):
        assert not ran, "the planted payload ran"
        assert message is not None and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in message, message
        assert "builtins.getattr" in message and "weights_only=False" in message, message


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(runs, layout):
    reference, (rank0, rank1) = runs.reference, runs.ranks
    assert len(reference[0]) == STEPS
    assert_parity(rank0[layout], reference, layout, rtol=RTOL)
    assert_parity(rank1[layout], reference, f"{layout} rank 1", rtol=RTOL)
    config, zero = rank0[f"{layout} config"], rank0[f"{layout} config"]["zero_optimization"]
    # What reached DeepSpeed: the stage and offload, the LLM defaults, and the Trainer's clip value, batch and fp32.
    assert zero["stage"] == LAYOUTS[layout]["zero_stage"] and zero["overlap_comm"] and zero["contiguous_gradients"]
    assert ("offload_optimizer" in zero) == ("offload" in LAYOUTS[layout])
    assert config["gradient_clipping"] == 0.5 and config["train_micro_batch_size_per_gpu"] == GLOBAL_BATCH // 2
    assert "bf16" not in config and "fp16" not in config
    # Buckets the user did not size are capped at the model's size (131k elements), not 200M.
    numel = sum(p.numel() for p in reference[1].values())
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == numel


@pytest.mark.distributed
def test_validate_alone_builds_an_inference_engine_with_the_same_loss(runs):
    rank0, rank1 = runs.ranks
    assert rank0["validate"]["val_loss"] > 5.0  # untrained: near ln(256)
    assert rank0["validate"] == rank1["validate"] == pytest.approx(runs.reference_validation, rel=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zero1", "zero2", "zero3"])
def test_checkpoint_resume_continues_like_an_uninterrupted_run(runs, layout):
    rank0 = runs.ranks[0]
    losses, params = rank0[f"{layout} resumed"]
    uninterrupted_losses, uninterrupted_params = rank0[layout]
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted_losses), rtol=1e-6, atol=0)
    for name, value in uninterrupted_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
def test_each_rank_holds_its_share_of_model_states(runs):
    rank0, rank1 = runs.ranks
    full = sum(p.numel() * 4 for p in runs.reference[1].values())  # fp32 parameters of the whole model
    table = "\n".join(
        f"{name:14}" + ", ".join(f"{k}={v:,}" for k, v in sorted(rank0[f"{name} bytes"].items())) for name in LAYOUTS
    )
    print(f"\nper-rank bytes before the last step (2 ranks; all fp32 parameters = {full:,}):\n{table}")
    for name in LAYOUTS:
        for got in (rank0[f"{name} bytes"], rank1[f"{name} bytes"]):
            # AdamW's two moments and the fp32 master copy, sharded over 2 ranks (plus a little padding).
            assert full <= got["optimizer_state"] <= 1.01 * full, (name, got)
            assert 0.5 * full <= got["master_weights"] <= 0.51 * full, (name, got)
    assert rank0["zero1 bytes"]["parameters"] == rank0["zero2 bytes"]["parameters"] == full  # replicated below stage 3
    for name in ("zero3", "zero3_offload"):
        assert 0.5 * full <= rank0[f"{name} bytes"]["parameters"] <= 0.51 * full  # stage 3: a half per rank
        assert rank0[f"{name} bytes"]["gradients"] <= 0.51 * full


@pytest.mark.distributed
def test_auto_takes_the_planners_stage_with_inputs_from_the_datamodule(runs):
    rank0 = runs.ranks[0]
    # Given memory for ZeRO 3 but not 2, the planner picks 3 and the engine is built with it (the config
    # held stage 2 until then); the micro-batch shape was read from the datamodule.
    assert rank0["auto decision"] == (3, "none") and rank0["auto stage"] == 3
    (call,) = rank0["auto calls"]
    assert call["model"] == "CausalLM" and call["device_memory"] == runs.auto_memory
    assert {
        k: call[k]
        for k in (
            "world_size",
            "tp",
            "pp",
            "micro_batch_size",
            "seq_len",
            "precision",
            "backend",
            "allow_offload",
            "activation_checkpointing",
            "margin",
        )
    } == {
        "world_size": 2,
        "tp": 1,
        "pp": 1,
        "micro_batch_size": GLOBAL_BATCH // 2,
        "seq_len": 32,
        "precision": "32-true",
        "backend": "deepspeed",
        "allow_offload": True,
        "activation_checkpointing": "none",
        "margin": PLANNER_MARGIN,
    }
    assert_parity(rank0["auto"], runs.reference, "auto -> zero3", rtol=RTOL)


def test_missing_deepspeed_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what `import deepspeed` sees when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'lightning_llm\[deepspeed\]'"):
        LLMDeepSpeedStrategy(zero_stage=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(zero_stage=4), r"zero_stage=4 is not supported: choose 1, 2, 3 or 'auto'"),
        (dict(zero_stage=0), r"zero_stage=0 .* use strategy='ddp'"),
        (dict(offload="disk"), r"offload='disk' is unknown: choose one of 'none', 'optimizer'"),
        (dict(zero_stage=2, offload="optimizer+params"), r"needs zero_stage=3 \(got 2\)"),
        (dict(zero_stage=3, offload="auto"), r"chooses the stage and the offload together"),
        (dict(zero_stage="auto", offload="optimizer"), r"chooses the stage and the offload together"),
        (dict(offload="optimizer", offload_device="nvme"), r"offload_device='nvme' needs nvme_path"),
        (dict(zero_stage=3, config={"zero_optimization": {"stage": 2}}), r"config sets zero_optimization.stage=2"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMDeepSpeedStrategy(**kwargs)


def test_precision_contradicting_the_trainer_is_refused_before_training():
    model = make_model("reference")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=1,
        logger=False,
        strategy=LLMDeepSpeedStrategy(zero_stage=1, config={"bf16": {"enabled": True}}),
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(ValueError, match=r"enables 'bf16' but the Trainer runs with precision='32-true'"):
        trainer.fit(model, data(4))
    assert trainer.global_step == 0


def test_cpu_training_needs_deepspeeds_cpu_accelerator(monkeypatch):
    import deepspeed.accelerator

    # What DeepSpeed picks on a machine with a GPU when the Trainer is told to use the CPU.
    cuda = types.SimpleNamespace(device_name=lambda: "cuda")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: cuda)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        strategy=LLMDeepSpeedStrategy(),
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(RuntimeError, match=r"selected 'cuda'\. Set the environment variable DS_ACCELERATOR=cpu"):
        trainer.fit(make_model("reference"), data(4))


def test_user_config_dict_or_file_is_merged_over_the_defaults(tmp_path):
    user = {"zero_optimization": {"reduce_bucket_size": 1000}, "steps_per_print": 7}
    path = tmp_path / "ds.json"
    path.write_text(__import__("json").dumps(user))
    for config in (user, str(path)):
        merged = LLMDeepSpeedStrategy(zero_stage=3, offload="optimizer+params", config=config).config
        zero = merged["zero_optimization"]
        assert zero["reduce_bucket_size"] == 1000 and merged["steps_per_print"] == 7
        assert zero["stage"] == 3 and zero["overlap_comm"] and zero["stage3_param_persistence_threshold"] == 1e5
        assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert "offload_param" not in default_config(zero_stage=3, offload="optimizer")["zero_optimization"]
    assert merge_config({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {"a": {"b": 1, "c": 3}, "d": 4}
    with pytest.raises(FileNotFoundError, match="missing.json"):
        LLMDeepSpeedStrategy(config=str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    ("name", "stage", "offload"),
    [
        ("llm_deepspeed_zero1", 1, None),
        ("llm_deepspeed_zero2", 2, None),
        ("llm_deepspeed_zero3", 3, None),
        ("llm_deepspeed_zero2_offload", 2, "offload_optimizer"),
        ("llm_deepspeed_zero3_offload", 3, "offload_param"),
    ],
)
def test_registered_names_build_the_strategy(name, stage, offload):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, LLMDeepSpeedStrategy) and trainer.strategy.zero_stage == stage
    assert offload is None or offload in trainer.strategy.config["zero_optimization"]
    assert StrategyRegistry["llm_deepspeed_auto"]["init_params"] == {"zero_stage": "auto", "offload": "auto"}


def test_yaml_config_and_preset_name_parse_through_the_cli(tmp_path, monkeypatch):
    from lightning_llm.cli import LLMCLI

    monkeypatch.chdir(tmp_path)
    cli = LLMCLI(args=["--config", str(CONFIG), "--trainer.logger", "false"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, LLMDeepSpeedStrategy) and strategy.zero_stage == 2
    assert strategy.config["zero_optimization"]["reduce_bucket_size"] == 5e7 and strategy.num_processes == 2
    cli = LLMCLI(
        args=["--config", str(CONFIG), "--trainer.logger", "false", "--trainer.strategy", "llm_deepspeed_zero3"],
        run=False,
    )
    assert isinstance(cli.trainer.strategy, LLMDeepSpeedStrategy) and cli.trainer.strategy.zero_stage == 3
