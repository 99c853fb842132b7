import pytest
import torch

from lightning_llm.modeling.shape import ModelShape, counted_flops_per_token
from lightning_llm.models import CausalLM, Llama, LlamaConfig
from lightning_llm.planning.flops import peak_flops, precision_dtype
from lightning_llm.testing.models import HFCausalLM


def test_formula_on_the_reference_model_by_hand():
    config = LlamaConfig.from_name("tiny")  # vocab 256, dim 64, 2 layers, ffn 192, kv heads 2 of 4
    shape = ModelShape.of(Llama(config))
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v (2 kv heads x 16), o
    mlp = 3 * 64 * 192
    block = attention + mlp + 2 * 64  # + two norm weights
    n = 2 * block + 64 + 256 * 64  # blocks, final norm, output head (input embedding excluded)
    assert shape.matmul_parameters == n
    assert shape.flops_per_token(128) == 6 * n + 12 * 2 * 64 * 128


def test_tied_head_counts_once_and_embeddings_do_not():
    untied = ModelShape.of(Llama(LlamaConfig.from_name("tiny")))
    tied = ModelShape.of(Llama(LlamaConfig.from_name("tiny", tie_embeddings=True)))
    assert untied.matmul_parameters == tied.matmul_parameters


@pytest.mark.parametrize("arch", ["reference", "hf_llama"])
def test_formula_agrees_with_torchs_flop_counter_within_5_percent(arch):
    torch.manual_seed(0)
    if arch == "reference":
        module = CausalLM(LlamaConfig.from_name("small"))
        module.configure_model()
    else:
        module = HFCausalLM("llama", hidden=256, layers=4, heads=8, kv_heads=4)
    module.log = lambda *a, **k: None
    batch = torch.randint(0, 256, (2, 257))
    counted = counted_flops_per_token(module, lambda: module.training_step(batch, 0), tokens=2 * 256)
    formula = ModelShape.of(module).flops_per_token(256)
    assert counted == pytest.approx(formula, rel=0.05)


def test_peak_table_lookup():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert peak_flops("NVIDIA H100 NVL", "bf16") == 835.5e12
    assert peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops("NVIDIA B200", "bf16") == 2.25e15
    assert peak_flops("NVIDIA GB200", "bf16") == 2.5e15
    assert peak_flops("AMD Instinct MI300X", "bf16") == 1307.4e12
    assert peak_flops("NVIDIA L40S", "fp32") == 91.6e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert peak_flops("Some CPU", "bf16") is None
    assert precision_dtype("bf16-mixed") == "bf16" and precision_dtype("32-true") == "fp32"
    assert precision_dtype("16-mixed") == "fp16"


def test_fp8_peaks_are_twice_bf16_where_the_card_has_fp8_units():
    from lightning_llm.planning.flops import PEAK_FLOPS, peak_flops, precision_dtype

    # Hopper, Ada, Blackwell and CDNA3 datasheets: dense fp8 = 2x dense bf16 (L40S: 733 vs 362.05, the datasheet's
    # own rounding, hence 2%). A100 and A10G have no fp8 units.
    for device, name in [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA L40S", "L40S"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA B200", "B200"),
    ]:
        assert peak_flops(device, "fp8") == pytest.approx(2 * PEAK_FLOPS[name]["bf16"], rel=0.02), device
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_flops("NVIDIA A10G", "fp8") is None
    assert precision_dtype("transformer-engine") == precision_dtype("transformer-engine-float16") == "fp8"
