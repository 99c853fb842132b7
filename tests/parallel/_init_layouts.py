"""Rank functions for the exact-initialization tests (spawned by tests/parallel/test_materialize.py)."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import lightning_llm.parallel.init.materialize as materialize_module
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer
from lightning_llm.testing.models import HFCausalLM

SEED = 1234
CONFIG = LlamaConfig.from_name("tiny", vocab_size=256, n_layers=2)
TIED = LlamaConfig.from_name("tiny", vocab_size=256, n_layers=2, tie_embeddings=True)


class LazyHF(HFCausalLM):
    """An HF Llama built in ``configure_model``, so the strategy's meta-device context applies."""

    def __init__(self, tie: bool = False) -> None:
        import transformers

        L.LightningModule.__init__(self)
        self.learning_rate = 0.5
        self.hf_config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            attn_implementation="sdpa",
            tie_word_embeddings=tie,
        )
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            import transformers

            self.model = transformers.LlamaForCausalLM(self.hf_config)


class Capture(L.Callback):
    """Gathers the weights as setup left them, before any step."""

    def on_fit_start(self, trainer, pl_module) -> None:
        self.was_meta = False
        self.params = gathered_parameters(pl_module)


def build(arch: str) -> L.LightningModule:
    return {"reference": lambda: CausalLM(CONFIG), "tied": lambda: CausalLM(TIED), "hf_llama": LazyHF}[arch]()


def gathered_parameters(module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded and merged over pipeline stages, on every rank."""
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().clone() for k, v in state.items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, state)
    return {k: v for part in parts for k, v in part.items()}


def init_under_layouts(cases: list[tuple[str, dict]], devices: int) -> list[dict]:
    """For each (arch, strategy kwargs): build in configure_model, set up through ``Trainer.fit``, gather the weights."""
    from lightning_llm.data import LLMDataModule

    # Tiny chunks so the row-chunked drawing of FSDP shards is exercised too.
    materialize_module._CHUNK_ELEMENTS = 48
    results = []
    for arch, kwargs in cases:
        torch.manual_seed(SEED)
        module, capture = build(arch), Capture()
        trainer = cpu_trainer(
            devices=devices,
            strategy=LLMParallelStrategy(**kwargs),
            max_steps=0,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[capture],
        )
        trainer.fit(module, LLMDataModule(num_tokens=4000, seq_len=16, batch_size=4, seed=0))
        tied = None
        if arch == "tied" and kwargs.get("pipeline_parallel_size", 1) == 1:
            tied = module.model.output.weight is module.model.tok_embeddings.weight
        results.append({"params": capture.params if dist.get_rank() == 0 else None, "tied": tied})
    return results
