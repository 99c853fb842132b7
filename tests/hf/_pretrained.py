"""Fine-tuning from a saved tiny Hugging Face model: single process (from_pretrained) vs sharded layouts (load_pretrained)."""

from __future__ import annotations

import torch

from lightning_llm.data import LLMDataModule
from lightning_llm.testing import cpu_trainer
from lightning_llm.testing.models import _NextTokenModule
from tests.strategies._parity import GlobalLoss

STEPS = 10


def hf_config(arch: str):
    import transformers

    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    if arch == "qwen3_moe":  # stacked experts (4, top-2) in every block
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, head_dim=16)
        return transformers.Qwen3MoeConfig(**kwargs, **moe)
    return transformers.LlamaConfig(**kwargs) if arch == "llama" else transformers.Qwen2Config(**kwargs)


def hf_class(arch: str) -> type:
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[arch]


class PretrainedLM(_NextTokenModule):
    """Builds the HF model in configure_model: from the config (then weights come from the strategy) or from a directory."""

    def __init__(self, arch: str, from_dir: str | None = None, **config_overrides) -> None:
        super().__init__(learning_rate=0.5)
        self.arch, self.from_dir, self.model, self.overrides = arch, from_dir, None, config_overrides

    def configure_model(self) -> None:
        if self.model is None:
            cls = hf_class(self.arch)
            config = hf_config(self.arch)
            for key, value in self.overrides.items():
                setattr(config, key, value)
            self.model = cls.from_pretrained(self.from_dir) if self.from_dir else cls(config)

    def logits(self, tokens):
        return self.model(input_ids=tokens, use_cache=False).logits


def save(arch: str, path: str) -> None:
    torch.manual_seed(7)
    hf_class(arch)(hf_config(arch)).save_pretrained(path)


def finetune(
    arch: str,
    path: str,
    strategy_kwargs: dict | None,
    devices: int,
    per_rank_batch: int,
    strategy_cls=None,
    **config_overrides,
) -> list[float]:
    from lightning_llm.strategies import LLMParallelStrategy

    torch.manual_seed(0)
    losses = GlobalLoss()
    if strategy_kwargs is None:
        module, strategy = PretrainedLM(arch, from_dir=path), "auto"
    else:
        strategy = (strategy_cls or LLMParallelStrategy)(load_pretrained=path, **strategy_kwargs)
        module = PretrainedLM(arch, **config_overrides)
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[losses],
    )
    trainer.fit(module, LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=per_rank_batch, seed=3))
    return losses.losses


def finetune_layouts(paths: dict[str, str]) -> dict:
    out = {}
    for arch, path in paths.items():
        out[(arch, "zero3_dp2")] = finetune(arch, path, {"zero_stage": 3}, 2, 4)
        out[(arch, "tp2")] = finetune(arch, path, {"tensor_parallel_size": 2}, 2, 8)
        # Two stages of one block each; every rank sees the whole batch (dp = 1), split into 4 micro-batches.
        out[(arch, "pp2")] = finetune(arch, path, {"pipeline_parallel_size": 2, "num_microbatches": 4}, 2, 8)
    return out


def finetune_deepspeed(paths: dict[str, str]) -> dict:
    """ZeRO 3 dp=2 under LLMDeepSpeedStrategy (every parameter partitioned), and its refusals' messages."""
    from lightning_llm.strategies import LLMDeepSpeedStrategy

    shard_all = {"zero_stage": 3, "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    out = {arch: finetune(arch, path, shard_all, 2, 4, LLMDeepSpeedStrategy) for arch, path in paths.items()}
    for case, (arch, path, overrides) in {
        "unexpected": ("llama", paths["qwen2"], {}),
        "mis-shaped": ("llama", paths["llama"], {"intermediate_size": 96}),
    }.items():
        try:
            finetune(arch, path, shard_all, 2, 4, LLMDeepSpeedStrategy, **overrides)
            out[case] = "loaded"
        except ValueError as err:
            out[case] = str(err)
    return out
