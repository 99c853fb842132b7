"""The supported-architectures table, generated from the test matrix (``python -m tests.zoo.matrix``).

Each parity test module declares the models and layouts it trains against one process; :func:`cells` reads
those declarations (the same lists the tests parametrize over), and :data:`MECHANISMS` says which
architecture mechanism each model stands for. ``docs/models.md`` holds the table between markers;
``tests/zoo/test_matrix.py`` fails when the file and the tests disagree, when a tested model has no mechanism,
or when a mechanism names a model no test trains.

    python -m tests.zoo.matrix           # print the table
    python -m tests.zoo.matrix --write   # rewrite it in docs/models.md
"""

from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BEGIN, END = (
    "<!-- architectures-table:begin (generated: python -m tests.zoo.matrix --write) -->",
    ("<!-- architectures-table:end -->"),
)

# Mechanism -> the models whose cells prove it (model names as the test modules use them).
MECHANISMS = {
    "GQA attention, gated MLP (Llama-style)": ["llama", "qwen2", "litgpt_llama"],
    "sliding-window attention": ["mistral", "gemma2"],
    "per-head q/k norms": ["qwen3", "olmo2"],
    "one norm module per head (a ModuleList per q/k)": ["stablelm_qk_norms"],
    "tied embeddings": ["gemma3", "gpt2"],
    "fused QKV [q, k, v] and [gate, up]": ["phi3", "litgpt_pythia"],
    "fused QKV contiguous per head": ["gpt_neox"],
    "fused QKV of no known layout, read off the forward": ["mpt", "bloom_alibi"],
    "Conv1D projections": ["gpt2"],
    "MoE, stacked experts": ["mixtral", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe", "ernie45_moe"],
    "MoE, one module per expert (ModuleList)": ["litgpt_moe"],
    "parallel residual (attention beside the MLP)": ["phi", "cohere"],
    "partial rotary embeddings": ["stablelm", "phi"],
    "biased projections": ["starcoder2"],
    "layers without rotary embeddings": ["smollm3"],
    "linear attention (gated delta-net) beside attention, shared expert": ["qwen3_next"],
    "multi-query attention (fused / separate k,v)": ["gpt_bigcode_mqa", "falcon_mqa", "llama_mqa"],
    "fused QKV grouped per KV head": ["falcon_grouped"],
    "ALiBi": ["bloom_alibi"],
    "attention sinks (per-head parameters)": ["gpt_oss_sinks"],
    "multi-head latent attention": ["deepseek_v3_mla", "deepseek_v3"],
    "hybrid Mamba + attention, MoE beside dense": ["jamba"],
    "Mamba-2 mixers beside attention (in other layers or in the same block)": ["bamba", "falcon_h1"],
    "short convolution beside attention (a halo under context parallelism)": ["lfm2"],
    "MoE router inside a gate module": ["hunyuan_moe"],
    "MoE, every expert on every token, scaled by the router (Llama 4)": ["llama4"],
    "dense and MoE blocks of one class": ["deepseek_v3"],
    "blocks in a user's nn.Sequential": ["user_sequential"],
    "blocks returning tuples": ["hf_gpt_neo", "hf_falcon", "user_tuple"],
    "blocks returning a ModelOutput": ["user_model_output"],
    "this package's Llama (dense; MoE with shared experts)": ["reference", "reference_moe"],
    "packed documents (document-masked attention)": ["reference_documents"],
}
COLUMNS = {  # layout names of the test modules -> table column
    "dp2_zero3": "ZeRO-3",
    "tp2": "tp2",
    "tp2_sp": "tp2+SP",
    "dp2xtp2": "dp2×tp2",
    "pp2": "pp2",
    "pp2-1f1b": "pp2",
    "pp2-interleaved1f1b-v2": "pp2 interleaved",
    "ac_selective": "AC selective",
    "ac_full": "AC full",
    "zero_auto": "ZeRO auto",
    "deepspeed_zero3": "DeepSpeed ZeRO-3",  # tests/zoo/test_deepspeed_zoo.py
    # context parallelism (tests/strategies/test_context_parallel_parity.py)
    "cp2": "CP2 ring",
    "cp2_zero3": "CP2 ring",
    "cp2_zero3_ac": "CP2 ring",
    "cp2_mb1": "CP2 ring",
    "cp2_zero3_mb1": "CP2 ring",
    "cp2_zero3_full_ac_mb1": "CP2 ring",
    "cp2_auto": "CP2 ring",
    "dp2_cp2_zero3": "CP2 ring",
    "cp2_ulysses_zero3": "CP2 Ulysses",
    "cp2_tp2": "CP2×tp2",
    "cp2_tp2_sp": "CP2×tp2",
    "cp2_tp2_sp_mb1": "CP2×tp2",
    "cp2_pp2": "CP2×pp2",
    # expert parallelism (tests/strategies/test_expert_parallel_parity.py)
    "ep2_zero0": "EP2",
    "ep2_zero1": "EP2",
    "ep2_zero3": "EP2",
    "ep2_zero3_ac_full": "EP2",
    "ep2_zero3_clip": "EP2",
    "ep2xdp2_zero0": "EP2",
    "ep2xdp2_zero3": "EP2",
    "ep4_zero3": "EP2",
    "ep2xtp2_sp_zero3": "EP2×tp2",
    "ep2xpp2_zero3": "EP2×pp2",
}


def cells() -> dict[str, set[str]]:
    """Model -> the table columns some parity test trains it under (the tests' own parametrization lists)."""
    from tests.strategies import test_pipeline_tuples
    from tests.zoo import (
        test_attention_variants,
        test_deepspeed_zoo,
        test_hybrid_blocks,
        test_hybrid_tensor_parallel,
        test_more_architectures,
        test_zoo,
    )

    matrices = [
        (test_zoo.MODELS, test_zoo.LAYOUTS),
        (test_attention_variants.MODELS, test_attention_variants.TP_LAYOUTS),
        (test_hybrid_blocks.HYBRID_MODELS, test_hybrid_blocks.LAYOUTS),
        (test_hybrid_tensor_parallel.MODELS, test_hybrid_tensor_parallel.LAYOUTS),
        (test_pipeline_tuples.MODELS, test_pipeline_tuples.LAYOUTS),
        (test_more_architectures.MORE_MODELS, test_more_architectures.LAYOUTS),
    ]
    tested: dict[str, set[str]] = {}
    for models, layouts in matrices:
        for model in models:
            tested.setdefault(model, set()).update(COLUMNS[layout] for layout in layouts)
    for layout, model in test_attention_variants.OTHER_CELLS:
        tested[model].add(COLUMNS[layout])
    from tests.strategies import (
        test_activation_checkpointing_layouts,
        test_context_parallel_parity,
        test_expert_parallel_parity,
        test_parallel_parity,
        test_pipeline_parity,
    )

    # The reference model's own parity tests (the other models there are the zoo's rows' cousins, not mechanisms).
    reference_layouts = {
        "dp2-zero3": "ZeRO-3",
        "tp2": "tp2",
        "tp2-sp": "tp2+SP",
        "dp2xtp2-zero3-sp": "dp2×tp2",
        "pp2-1f1b": "pp2",
        "pp2-interleaved1f1b-v2": "pp2 interleaved",
    }
    declared = {
        *test_parallel_parity.TWO_RANKS,
        *test_parallel_parity.FOUR_RANKS,
        *test_pipeline_parity.PP2,
    }
    assert "reference" in test_parallel_parity.ARCHS and "reference" in test_pipeline_parity.ARCHS
    tested.setdefault("reference", set()).update(c for layout, c in reference_layouts.items() if layout in declared)
    modes = {ac["activation_checkpointing"] for ac in test_activation_checkpointing_layouts.AC.values()}
    tested["reference"].update(f"AC {mode}" for mode in ("selective", "full") if mode in modes)
    pairs = list(test_context_parallel_parity.CASES)
    pairs += test_expert_parallel_parity.CELLS
    pairs += [(layout, m) for layout in test_deepspeed_zoo.LAYOUTS for m in test_deepspeed_zoo.MODELS]
    for layout, model in pairs:
        tested.setdefault(model, set()).add(COLUMNS[layout])
    return tested


def table() -> str:
    """The markdown table: one row per mechanism, one column per layout, ✓ where a model of the row is tested."""
    tested = cells()
    columns = list(dict.fromkeys(COLUMNS.values()))
    lines = [
        "| mechanism | models | " + " | ".join(columns) + " |",
        "| --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for mechanism, models in MECHANISMS.items():
        covered = set().union(*(tested.get(m, set()) for m in models))
        marks = ["✓" if column in covered else "" for column in columns]
        lines.append(f"| {mechanism} | {', '.join(models)} | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def render(document: str) -> str:
    """``document`` with the text between the markers replaced by the generated table."""
    start, end = document.index(BEGIN) + len(BEGIN), document.index(END)
    return document[:start] + "\n" + table() + "\n" + document[end:]


if __name__ == "__main__":
    if "--write" in sys.argv:
        DOC.write_text(render(DOC.read_text()))
    else:
        print(table())
