"""Any Hugging Face causal LM, built tiny from its config class, under the strategy's layouts against one process.

What a new user does with an architecture nobody here named: a tiny config built in code (hidden 32, 2 layers,
4 heads, 2 KV heads, vocab 128; MoE models 4 experts, top 2; nothing downloaded), the plainest LightningModule
(``model(input_ids)``, shifted cross entropy, AdamW: the zoo's ``ZooLM``), 4 steps on 2 CPU ranks under each
layout, no plan entry. Per cell: the largest relative per-step loss difference and per-parameter error against
one process, whether the ranks holding a parameter agree, and the largest share of the attention and expert
parameters any rank holds; or the first line of the error the strategy raised. Each model runs in its own
process group (a rank failing alone cannot stall the others) with a timeout.

    python benchmarks/architecture_sweep.py --models Cohere2 Olmo3 HunYuanMoEV1 --layouts tp2 tp2_sp pp2
    python benchmarks/architecture_sweep.py --float64 --models Glm4 --layouts tp2   # rounding, or a real gap?
    python benchmarks/architecture_sweep.py --models Lfm2 NemotronH --layouts cp2 cp2_ulysses
    python benchmarks/architecture_sweep.py --models Zamba2 --layouts tp2 \
        --replicate "model.model.layers.*.shared_transformer.feed_forward"        # the entry a refusal names

``--models`` takes the names before ``ForCausalLM`` in transformers (``Llama4`` builds ``Llama4TextConfig``);
:data:`OVERRIDES` holds the few config fields some architectures need to build tiny (MLA ranks, Mamba heads,
jitter and dropout off so both sides draw no random numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.zoo's harness

from lightning_llm.testing import run_distributed
from tests.zoo._models import _DENSE, BUILDERS

COMMON = dict(
    _DENSE,
    head_dim=8,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    residual_dropout=0.0,
    hidden_dropout=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
_MLA = dict(
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4
)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8)
_LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
# Architecture -> (config fields to drop from COMMON, fields to set).
OVERRIDES = {
    "OPT": ((), dict(dropout=0.0, layerdrop=0.0)),  # dropout on by default, under its own field name
    "XGLM": ((), dict(dropout=0.0, activation_dropout=0.0, layerdrop=0.0)),
    "BioGpt": ((), dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, activation_dropout=0.0)),
    "DeepseekV2": (("head_dim",), dict(_MLA, topk_method="greedy")),
    "MiniCPM3": (("head_dim",), _MLA),
    "Glm4MoeLite": (("head_dim",), _MLA),
    "Mistral4": (("head_dim",), _MLA),
    "Youtu": (("head_dim",), _MLA),
    "Qwen3_5": ((), dict(_LINEAR, layer_types=["linear_attention", "full_attention"])),
    "Qwen3_5Moe": ((), dict(_LINEAR, layer_types=["linear_attention", "full_attention"])),
    "Bamba": ((), dict(_MAMBA2, attn_layer_indices=[1])),
    # Hybrids whose default layer pattern puts no attention in 2 layers (their forward then fails in one process).
    "Jamba": ((), dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1)),
    "Lfm2": ((), dict(layer_types=["conv", "full_attention"])),
    "Lfm2Moe": ((), dict(layer_types=["conv", "full_attention"])),
    "GraniteMoeHybrid": ((), dict(_MAMBA2, layer_types=["mamba", "attention"])),
    "Zamba2": (
        (),
        dict(
            num_hidden_layers=3,  # two hybrid layers calling one shared transformer, as Zamba2 does
            layer_types=["mamba", "hybrid", "hybrid"],
            hybrid_layer_ids=[1, 2],
            mamba_headdim=8,
            mamba_d_state=8,
            n_mamba_heads=8,
            num_mem_blocks=1,
        ),
    ),
    "Llama4": ((), dict(intermediate_size_mlp=64, interleave_moe_layer_step=2)),
    "StableLm": ((), dict(qk_layernorm=True, use_parallel_residual=True)),  # StableLM 2 12B's per-head q/k norms
    "Dots3Note": ((), dict(num_key_value_heads=4)),  # its config requires as many k/v heads as query heads
    "Zaya": ((), dict(num_experts_per_tok=1)),  # "ZAYA currently supports num_experts_per_tok=1 only"
    "CodeGen": ((), dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    "GPTJ": ((), dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    "Phimoe": ((), dict(router_jitter_noise=0.0, input_jitter_noise=0.0)),
    "Dbrx": (
        (),
        dict(
            d_model=32,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32, "ffn_act_fn": {"name": "silu"}},
        ),
    ),
}
LAYOUTS = ("tp2", "tp2_sp", "pp2", "dp2_zero3", "ac_selective", "cp2", "cp2_ulysses", "cp2_mb1", "cp2_zero3_mb1")
# Context parallelism (2 ranks, ZeRO 0: both CP ranks hold every parameter), not among the zoo harness's own layouts;
# cp2_mb1 on micro-batches of one sequence (4 accumulated per step), where other sequence mixers run on one rank each
# (local ones with a halo); cp2_zero3_mb1 the same with ZeRO-3 over the CP ranks.
CP_LAYOUTS = {
    "cp2": (2, {"context_parallel_size": 2, "zero_stage": 0}),
    "cp2_ulysses": (2, {"context_parallel_size": 2, "context_parallel_method": "ulysses", "zero_stage": 0}),
    "cp2_mb1": (2, {"context_parallel_size": 2, "zero_stage": 0}),
    "cp2_zero3_mb1": (2, {"context_parallel_size": 2, "zero_stage": 3}),
}
# The held-out set of docs/models.md ("Held out: ... as a new user would bring them"): ``--models held-out`` runs it,
# the table before and after any change to how models are read or split.
HELD_OUT = [
    "Cohere2",
    "Exaone4",
    "Olmo3",
    "Glm",
    "Helium",
    "Arcee",
    "Apertus",
    "SeedOss",
    "Ministral",
    "Ministral3",
    "Granite",
    "HunYuanDenseV1",
    "HunYuanMoEV1",
    "Dots1",
    "Qwen2Moe",
    "Phimoe",
    "MiniMaxM2",
    "Lfm2",
    "FalconH1",
    "NemotronH",
    "Afmoe",
    "Ernie4_5",
    "VaultGemma",
    "Gemma",
    "FlexOlmo",
    "Olmo",
    "Nemotron",
    "Mpt",
    "Cohere2Moe",
    "SolarOpen",
    "Laguna",
    "Qwen3_5",
    "Qwen3_5Moe",
    "Bamba",
    "Llama4",
    "CodeGen",
    "GPTJ",
    "DeepseekV2",
    "MiniCPM3",
    "Glm4MoeLite",
    "Mistral4",
    "Youtu",
    "OlmoHybrid",
    "Glm4",
    "Jais2",
    "Persimmon",
    "JetMoe",
    "Dbrx",
    "MiniMax",
    "Zamba2",
    "BitNet",
    "DiffLlama",
    "GraniteMoeHybrid",
    "Doge",
    "StableLm",
]
# Decoder-only architectures newer than the held-out set (transformers 5.24), ``--models newest``.
NEWEST = [
    "Gemma4",
    "Dots3Note",
    "DeepseekV32",
    "DeepseekV4",
    "Qwen4Exp",
    "KimiLinear",
    "HYV3",
    "HYV4",
    "Inkling2",
    "Lfm3",
    "Lfm2Moe",
    "LongcatFlash",
    "MiMoV2Flash",
    "NanoChat",
    "GlmMoeDsa",
    "GraniteMoeSWA",
    "GraniteMoeShared",
    "GraniteSWA",
    "Apertus1p5Text",
    "Flint",
    "Kolibri1",
    "LaraMini",
    "Zaya",
    "Dory",
    "Beam",
    "Cwm",
    "ExaoneMoe",
    "BailingHybrid",
]


# Causal LMs of transformers 5.24 in neither set above, run on 2026-11-30 (docs/models.md, "A third round"):
# ``--models later``. Not in it: AXK1, AXK2, Mamba2, RecurrentGemma, xLSTM and Gemma3n (their tiny configs from these
# sizes fail in one process), Inkling2Loop (timed out at 300 s).
LATER = [
    "AriaText",
    "Ernie4_5_Moe",
    "HyperCLOVAX",
    "Mellum",
    "ModernBertDecoder",
    "FalconMamba",
    "HrmText",
    "OPT",
    "XGLM",
    "BioGpt",
    "Rwkv",
]


def builder(architecture: str):
    """A function building the tiny ``<architecture>ForCausalLM`` (seeded), for the zoo's ``ZooLM``."""
    import transformers

    # The text-only config where there is one (Llama4Config, Qwen3_5Config are the multimodal models').
    config_name = next(n for n in (f"{architecture}TextConfig", f"{architecture}Config") if hasattr(transformers, n))
    drop, extra = OVERRIDES.get(architecture, ((), {}))

    def build():
        config = getattr(transformers, config_name)(**{**{k: v for k, v in COMMON.items() if k not in drop}, **extra})
        model_class = getattr(transformers, f"{architecture}ForCausalLM")
        torch.manual_seed(0)
        return model_class(config)

    return build


def _register(architecture: str, float64: bool) -> str:
    if float64:
        torch.set_default_dtype(torch.float64)
    BUILDERS[architecture] = builder(architecture)
    return architecture


def _ranks(architecture: str, layouts: list[str], float64: bool, replicate: list[str]):
    from tests.zoo import _harness

    _harness.LAYOUTS.update(CP_LAYOUTS)
    _harness.ACCUMULATE.update(cp2_mb1=4, cp2_zero3_mb1=4)
    for layout in layouts:  # the modules the user keeps whole on purpose, under the layouts with tensor parallelism
        if replicate and "tensor_parallel_size" in _harness.LAYOUTS[layout][1]:
            _harness.LAYOUTS[layout][1]["tensor_parallel_replicate"] = replicate
    return _harness.train_zoo(layouts, [_register(architecture, float64)], every_rank=True)


def _first_cause(results: list):
    """Rank 0's result, or where it failed because another rank did (the peer closed the connection), that rank's
    error: a stage refusing a layout on rank 1 shows on rank 0 only as a lost connection."""

    def lost(result) -> bool:
        return isinstance(result, str) and "Connection closed by peer" in result

    if not lost(results[0]):
        return results[0]
    return next((r for r in results if isinstance(r, str) and not lost(r)), results[0])


def cells(
    architecture: str, layouts: list[str], float64: bool, timeout: float, replicate: list[str] = ()
) -> dict[str, str]:
    """Layout -> one line: the differences from one process, or the error."""
    from tests.zoo._harness import train

    try:
        ranks = run_distributed(_ranks, 2, architecture, layouts, float64, list(replicate), timeout=timeout)
    except Exception as error:  # a rank died, or the group hung: every cell says so
        return dict.fromkeys(layouts, f"group failed: {str(error).strip().splitlines()[-1][:200]}")
    reference, lines = None, {}
    for layout in layouts:
        result = _first_cause([rank[layout][architecture] for rank in ranks])
        if isinstance(result, str):
            lines[layout] = "refused/failed: " + result.strip().splitlines()[0][:240]
            continue
        reference = reference or train(_register(architecture, float64))
        losses, params, differing, _, held = result
        loss = max(abs(a - b) / abs(b) for a, b in zip(losses, reference[0]))
        error = max(((params[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in reference[1].items())
        shares = json.dumps({k: round(v, 3) for k, v in held.items()})
        lines[layout] = f"loss {loss:.1e}, params {error:.1e}, held {shares}, differing {len(differing)}"
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models",
        nargs="+",
        required=True,
        help="names before ForCausalLM, e.g. Cohere2 Olmo3; 'held-out', 'newest', 'later': the sets",
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--float64", action="store_true", help="train in float64 (rounding vanishes, bugs stay)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model's process group")
    parser.add_argument("--replicate", nargs="*", default=[], help="tensor_parallel_replicate patterns under tp")
    args = parser.parse_args()
    print("| model | layout | result |\n| --- | --- | --- |")
    sets = {"held-out": HELD_OUT, "newest": NEWEST, "later": LATER}
    models = [m for name in args.models for m in sets.get(name, [name])]
    for architecture in models:
        for layout, line in cells(architecture, args.layouts, args.float64, args.timeout, args.replicate).items():
            print(f"| {architecture} | {layout} | {line} |", flush=True)


if __name__ == "__main__":
    main()
