"""The model zoo: tiny configs of architectures nobody here wrote, built in code (nothing downloaded).

Each builder returns the bare model a user would hold; :class:`ZooLM` is the plainest LightningModule
around it: ``model(input_ids)`` with everything else at its default, cross entropy on shifted tokens,
AdamW at a fixed learning rate.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
import transformers
from litgpt import GPT, Config

VOCAB = 128
_DENSE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MOE = dict(_DENSE, intermediate_size=32)


def _hf(config_name: str, model_name: str, **kwargs):
    config = getattr(transformers, config_name)(**kwargs)
    model_class = getattr(transformers, model_name)  # a lazy import: it may draw random numbers, so before the seed
    torch.manual_seed(0)
    return model_class(config)


_LITGPT_LLAMA = dict(
    n_query_groups=2,
    intermediate_size=64,
    bias=False,
    rotary_percentage=1.0,
    parallel_residual=False,
    norm_class_name="RMSNorm",
)


def _litgpt(**kwargs):
    common = dict(block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32)
    config = Config(**common, **kwargs)
    torch.manual_seed(0)
    return GPT(config)


BUILDERS = {
    "llama": lambda: _hf("LlamaConfig", "LlamaForCausalLM", **_DENSE),
    "mistral": lambda: _hf("MistralConfig", "MistralForCausalLM", **_DENSE, sliding_window=8),
    "qwen2": lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", **_DENSE),
    "qwen3": lambda: _hf("Qwen3Config", "Qwen3ForCausalLM", **_DENSE, head_dim=8),
    "gemma2": lambda: _hf("Gemma2Config", "Gemma2ForCausalLM", **_DENSE, head_dim=8, sliding_window=8),
    "gemma3": lambda: _hf(
        "Gemma3TextConfig", "Gemma3ForCausalLM", **_DENSE, head_dim=8, sliding_window=8, tie_word_embeddings=True
    ),
    "phi3": lambda: _hf("Phi3Config", "Phi3ForCausalLM", **_DENSE),
    "gpt_neox": lambda: _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **_DENSE, rotary_pct=0.5),
    "olmo2": lambda: _hf("Olmo2Config", "Olmo2ForCausalLM", **_DENSE),
    "gpt2": lambda: _hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "mixtral": lambda: _hf("MixtralConfig", "MixtralForCausalLM", **_MOE, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: _hf(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        **_MOE,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
    ),
    "litgpt_llama": lambda: _litgpt(**_LITGPT_LLAMA, mlp_class_name="LLaMAMLP"),
    "litgpt_pythia": lambda: _litgpt(
        n_query_groups=4,
        intermediate_size=128,
        bias=True,
        rotary_percentage=0.25,
        parallel_residual=True,
        norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP",
    ),
}
MODELS = list(BUILDERS)
MOE = ["mixtral", "qwen3_moe"]
# One module per expert in an nn.ModuleList, called by the model's own loop (litgpt's LLaMAMoE): expert
# parallelism's tests only (tests/strategies/test_expert_parallel_parity.py), not the zoo's layouts.
BUILDERS["litgpt_moe"] = lambda: _litgpt(
    **_LITGPT_LLAMA, mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32
)


class ZooLM(L.LightningModule):
    """What a user writes around a causal LM: forward, shifted cross entropy, AdamW."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = BUILDERS[name]()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        output = self.model(batch)
        logits = output if isinstance(output, torch.Tensor) else output.logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        # eps=1e-5 rather than 1e-8: a key bias has an exactly zero true gradient (softmax ignores a shift), so
        # its gradient is rounding noise (~1e-10) that Adam with a tiny eps turns into full-size steps, and two
        # correct runs summing in a different order would disagree there. The median gradient here is ~5e-4.
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-5)
