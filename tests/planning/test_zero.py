"""The memory planner: the ZeRO paper's numbers, measured bytes within 10%, and the automatic choice."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_llm.modeling.activations import parameter_counts
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.planning.memory import model_state_bytes
from lightning_llm.planning.zero import MemoryPlanError, parse_size
from lightning_llm.strategies.zero_auto import choose_zero_stage
from lightning_llm.testing import run_distributed
from lightning_llm.testing.memory import measure_model_states

GB = 1e9
ROOT = Path(__file__).parents[2]


def test_zero_paper_figure_1():
    # Psi = 7.5B, N_d = 64, mixed-precision Adam (K = 12): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device; DeepSpeed
    # also keeps an fp32 gradient partition (4 Psi / N_d = 0.47 GB, whole at stage 0: 30 GB) and at stage 3 no fp16
    # gradient partition beside it (-2 Psi / N_d = -0.23 GB), as its own estimators count.
    psi = 7.5e9
    totals = [
        sum(model_state_bytes(psi, zero_stage=s, dp=64, precision="bf16-mixed", backend="deepspeed")) / GB
        for s in (0, 1, 2, 3)
    ]
    fp32_grads, fp16_grads = 4 * psi / 64 / GB, 2 * psi / 64 / GB
    paper = [120, 31.41, 16.64, 1.875]
    expected = [
        paper[0] + 4 * psi / GB,
        paper[1] + fp32_grads,
        paper[2] + fp32_grads,
        paper[3] + fp32_grads - fp16_grads,
    ]
    assert totals == pytest.approx(expected, abs=0.01)


def _tiny():
    module = CausalLM("tiny")
    module.configure_model()
    return module


def test_auto_picks_stage_0_then_higher_then_offload_as_memory_shrinks():
    # 8 blocks: with the tiny model's 2, ZeRO 3's in-flight blocks (a prefetched all-gather, a reduce-scatter buffer)
    # outweigh what it shards, and ZeRO 2 is the smaller of the two.
    module = CausalLM(LlamaConfig.from_name("tiny", n_layers=8))
    module.configure_model()
    choices = []
    # Planned per rank (MiB): ZeRO 0 8.49, ZeRO 2 3.60, ZeRO 3 2.63, ZeRO 3 + CPU offload 0.85.
    for mib in (64, 4.0, 3.0, 1.0):
        decision = choose_zero_stage(
            module, device_memory=int(mib * 2**20), world_size=4, micro_batch_size=1, seq_len=8, margin=0.0
        )
        choices.append((decision.stage, decision.offload))
    # FSDP2 has one offload (parameters, gradients and optimizer state together): no optimizer-only row.
    assert choices == [(0, "none"), (2, "none"), (3, "none"), (3, "optimizer+params")]


def test_nothing_fits_is_refused_with_the_table_and_what_would_fit():
    module = _tiny()
    with pytest.raises(MemoryPlanError) as error:
        choose_zero_stage(
            module,
            device_memory=int(3.4 * 2**20),  # ZeRO 2 plans 4.58 MiB, 3.33 with full checkpointing
            world_size=2,
            micro_batch_size=4,
            seq_len=64,
            allow_offload=False,
            margin=0.0,
        )
    message = str(error.value)
    assert "No ZeRO stage fits 3.4 MiB per device" in message
    assert "ZeRO 0" in message and "ZeRO 3" in message and "usable device memory per rank: 3.40 MiB" in message
    assert "tensor_parallel_size=2" in message and "activation_checkpointing='full'" in message


@pytest.mark.distributed
@pytest.mark.parametrize("preset, world_size", [("tiny", 2), ("tiny", 4), ("50M", 2)])
def test_planned_bytes_match_measured_within_10_percent(preset, world_size):
    measured = run_distributed(_sweep, world_size, world_size, preset, timeout=300)[0]
    with torch.device("meta"):
        module = CausalLM(preset)
        module.configure_model()
    total, largest, outside = parameter_counts(module)
    for stage, row in zip((0, 1, 2, 3), measured):
        planned = sum(
            model_state_bytes(total, zero_stage=stage, dp=world_size, largest_block_params=largest, root_params=outside)
        )
        # Parameters at their fullest (the most gathered at any block's forward), gradients and state after the step.
        actual = row["params_peak"] + row["grads"] + row["optimizer"]
        assert actual == pytest.approx(planned, rel=0.10), f"stage {stage}: measured {actual}, planned {planned}"


def _sweep(world, preset):
    return [measure_model_states(world, preset, stage) for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize(
    "config, chosen",
    [("llama7b.yaml", "Chosen: ZeRO 2, offload none"), ("llama70b.yaml", "Chosen: ZeRO 2, offload none")],
)
def test_plan_command_prints_the_table_in_seconds(config, chosen):
    start = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_llm.cli",
            "plan",
            "--config",
            str(ROOT / "configs" / config),
            "--device_memory",
            "80GB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.monotonic() - start < 60
    assert "option" in result.stdout and "usable device memory per rank" in result.stdout
    assert chosen in result.stdout


def test_sizes_parse():
    assert parse_size("80GB") == 80 * 10**9 and parse_size("80GiB") == 80 * 2**30 and parse_size("24G") == 24 * 2**30
    with pytest.raises(ValueError, match="Cannot read the size 'lots'"):
        parse_size("lots")


def test_device_memory_reads_names_and_sizes_as_sold_as_the_cards_capacity():
    from lightning_llm.planning.device_memory import device_memory_bytes

    h100 = 81_559 * 2**20  # nvidia-smi's memory.total of an H100 80GB HBM3: 79.6 GiB, not 80e9 bytes (74.5 GiB)
    assert device_memory_bytes("H100") == device_memory_bytes("80GB") == device_memory_bytes(" h100 ") == h100
    assert device_memory_bytes("141GB") == device_memory_bytes("H200") == 143_771 * 2**20
    assert device_memory_bytes("a100_40gb") == 40 * 2**30
    assert device_memory_bytes("24GB") == 23_028 * 2**20  # several cards are sold as 24GB: the smallest of them
    assert device_memory_bytes("96GB") == 96 * 2**30  # no known card: the vendors' binary gigabytes
    assert device_memory_bytes("80GiB") == 80 * 2**30 and device_memory_bytes(12345) == 12345
    with pytest.raises(ValueError, match=r"Cannot read the device memory 'B300'.*H100, H200"):
        device_memory_bytes("B300")


def test_fp8_precisions_plan_like_16_bit_weights():
    # Lightning's TransformerEngine precisions: bf16 weights (2 B), gradients (2 B), Adam moments (2 x 2 B).
    psi = 1_000_000
    assert model_state_bytes(psi, zero_stage=0, dp=1, precision="transformer-engine") == (2 * psi, 2 * psi, 4 * psi)
    assert model_state_bytes(psi, zero_stage=2, dp=4, precision="transformer-engine-float16") == (2 * psi, psi / 2, psi)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("offload", [False, True])
def test_deepspeed_model_states_match_deepspeeds_own_estimator(stage, offload):
    pytest.importorskip("deepspeed", reason="DeepSpeed's estimator is the oracle")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from lightning_llm.planning.memory import model_state_bytes

    # A 7B model on 8 GPUs. The gathered layer is counted differently (DeepSpeed: 4 bytes per parameter of the largest
    # leaf layer; the planner: the largest block's 16-bit parameters), so it is left out here and checked below.
    psi, largest, gpus = 7e9, 0, 8
    ours = sum(
        model_state_bytes(
            psi,
            zero_stage=stage,
            dp=gpus,
            precision="bf16-mixed",
            backend="deepspeed",
            offload="optimizer" if offload else "none",
            largest_block_params=largest,
        )
    )
    if stage == 2:
        _, theirs = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=gpus, cpu_offload=offload)
    else:
        _, theirs, _ = estimate_zero3_model_states_mem_needs(
            psi, largest, num_gpus_per_node=gpus, cpu_offload=offload, cpu_offload_params=False
        )
    assert ours == pytest.approx(theirs, rel=1e-6)
    if stage == 3 and not offload:  # one gathered block: 2 bytes per parameter on top
        with_block = model_state_bytes(
            psi, zero_stage=3, dp=gpus, precision="bf16-mixed", backend="deepspeed", largest_block_params=2e8
        )
        assert sum(with_block) - ours == pytest.approx(2 * 2e8)


def test_context_parallelism_divides_activations_and_shards_over_dp_times_cp():
    from lightning_llm.planning.zero import estimate_options

    common = dict(num_params=8e9, largest_block=2e8, activations=64 * 2**30, world_size=16, precision="bf16-mixed")
    plain = {(r.zero_stage, r.offload): r for r in estimate_options(**common)}
    cp4 = {(r.zero_stage, r.offload): r for r in estimate_options(**common, cp=4)}
    # 16 ranks: dp 16, or dp 4 x cp 4; FSDP shards over dp x cp = 16 either way, activations split 4 ways.
    for key in plain:
        assert cp4[key].activations == plain[key].activations / 4
        assert (cp4[key].params, cp4[key].grads, cp4[key].optimizer) == (
            plain[key].params,
            plain[key].grads,
            plain[key].optimizer,
        )


def test_nothing_fits_names_context_parallelism_when_activations_are_the_problem():
    from lightning_llm.planning.memory import ModelFootprint
    from lightning_llm.planning.zero import plan_zero_stage

    long_sequences = ModelFootprint(1e9, 5e7, 2e8, activations=200 * 2**30, full_activations=120 * 2**30)
    with pytest.raises(MemoryPlanError, match="context_parallel_size=4"):
        plan_zero_stage(long_sequences, device_memory=80 * 2**30, world_size=8, allow_offload=False)


def test_expert_parallelism_divides_the_experts_by_ep_at_the_stages_that_keep_parameters_whole():
    from lightning_llm.planning.zero import estimate_options

    psi, experts, world, ep = 10e9, 8e9, 8, 4  # fp32: 4 bytes of parameters, 4 of gradients, 8 of AdamW state
    common = dict(num_params=psi, largest_block=0, activations=0.0, world_size=world, allow_offload=False)
    rows = {r.zero_stage: r for r in estimate_options(**common, ep=ep, expert_params=experts)}
    dense = {r.zero_stage: r for r in estimate_options(**common)}
    held = psi - experts + experts / ep  # the dense part whole, a quarter of the experts per rank
    # ZeRO 0: what each rank holds, twice (FSDP2's replicate keeps the sharded and the unsharded copy).
    assert rows[0].params == 2 * 4 * held and rows[0].optimizer == 8 * held
    # ZeRO 2: unsharded likewise, beside the shards (dense over 8 ranks, experts over the dp/ep = 2 outside the group);
    # gradients and optimizer state sharded over all 8 ranks as without EP.
    assert rows[2].params == pytest.approx(4 * held + 4 * (psi - experts) / world + 4 * (experts / ep) / (world // ep))
    assert (rows[2].grads, rows[2].optimizer) == pytest.approx((dense[2].grads, dense[2].optimizer))
    # ZeRO 3: experts 1/ep per rank, sharded over the dp/ep = 2 ranks outside the group: 1/8 like the rest.
    assert (rows[3].params, rows[3].grads, rows[3].optimizer) == pytest.approx(
        (dense[3].params, dense[3].grads, dense[3].optimizer)
    )


def test_the_footprint_counts_a_moe_models_experts():
    from lightning_llm.strategies.zero_auto import model_footprint
    from tests.zoo._models import ZooLM

    module = ZooLM("mixtral")
    footprint = model_footprint(module, micro_batch_size=1, seq_len=16)
    experts = sum(p.numel() for n, p in module.named_parameters() if ".experts." in n)
    assert experts > 0 and footprint.expert_params == experts


def test_plan_prints_the_global_batch(tmp_path, capsys):
    import yaml

    from lightning_llm.cli import main

    config = yaml.safe_load((ROOT / "configs" / "llama7b.yaml").read_text())
    config["trainer"]["accumulate_grad_batches"] = 4
    path = tmp_path / "llama7b_accumulate4.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["plan", "--config", str(path), "--devices", "8", "--device_memory", "80GB"])
    # micro-batch 1 x dp 8 x accumulate 4 = 32 sequences of 4096 tokens
    assert "global batch: 32 sequences, 131,072 tokens per optimizer step" in capsys.readouterr().out
