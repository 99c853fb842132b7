"""Blocks that return tuples or ModelOutputs pipeline exactly like one process.

Four models with 4 blocks each, none returning a bare tensor:

* Hugging Face ``GPTNeoForCausalLM``: ``GPTNeoBlock`` returns ``(hidden, attn_weights)`` and the model's loop
  reads ``outputs[0]``; called with ``use_cache`` at its default, so each block also appends to a KV cache
  (the stage that learns the output structure by running a block must not append twice);
* Hugging Face ``FalconForCausalLM``, whose blocks return ``(hidden, None)``;
* a hand-written decoder whose blocks return ``(hidden, aux)`` and whose loop unpacks ``hidden, _ = block(x)``
  (the pass-through must return a pair, not a tensor);
* the same decoder returning a ``ModelOutput`` read as ``.hidden_states``.

fp32, gradient clipping at 0.5, SGD: per-step losses and every parameter within 1e-5 relative error of a
single process, under 1F1B and Interleaved1F1B (2 stages per rank) on 2 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.utils import ModelOutput

from lightning_llm.data import LLMDataModule
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, train

pytestmark = pytest.mark.distributed

MODELS = ["hf_gpt_neo", "hf_falcon", "user_tuple", "user_model_output"]
LAYOUTS = {
    "pp2-1f1b": {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B", "num_microbatches": 4},
    "pp2-interleaved1f1b-v2": {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "Interleaved1F1B",
        "num_microbatches": 4,
        "virtual_stages": 2,
    },
}
VOCAB, WIDTH, LAYERS, STEPS, BATCH = 128, 32, 4, 3, 8


@dataclass
class BlockOutput(ModelOutput):
    hidden_states: torch.Tensor | None = None
    aux: torch.Tensor | None = None


class _Block(nn.Module):
    def __init__(self, model_output: bool) -> None:
        super().__init__()
        self.model_output = model_output
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc_in, self.fc_out = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 4, -1).transpose(1, 2) for y in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc_out(F.gelu(self.fc_in(self.ln2(x))))
        aux = q.square().mean()  # something beside the hidden state, as attention weights or a router loss would be
        return BlockOutput(hidden_states=x, aux=aux) if self.model_output else (x, aux)


class _UserDecoder(nn.Module):
    def __init__(self, model_output: bool) -> None:
        super().__init__()
        self.model_output = model_output
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(64, WIDTH)
        self.blocks = nn.ModuleList(_Block(model_output) for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            if self.model_output:
                x = block(x).hidden_states
            else:
                x, _ = block(x)
        return self.head(self.ln_f(x))


def _hf(name: str) -> nn.Module:
    if name == "hf_gpt_neo":
        config = transformers.GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, num_layers=LAYERS, num_heads=4, max_position_embeddings=64,
            attention_types=[[["global"], LAYERS]], bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        model_class = transformers.GPTNeoForCausalLM
    else:
        config = transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        model_class = transformers.FalconForCausalLM
    torch.manual_seed(0)
    return model_class(config)


class TinyLM(L.LightningModule):
    """Next-token cross entropy, SGD with momentum (sharper than Adam for parity: see testing/models.py)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name.startswith("hf_"):
            self.model = _hf(name)
        else:
            torch.manual_seed(0)
            self.model = _UserDecoder(model_output=name == "user_model_output")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.model(batch[:, :-1])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _data() -> LLMDataModule:
    return LLMDataModule(num_tokens=4_000, seq_len=16, batch_size=BATCH, vocab_size=VOCAB, seed=3)


def _run(name: str, strategy=None, devices: int = 1):
    return train(name, strategy, devices=devices, steps=STEPS, model=TinyLM(name), datamodule=_data())


def _pipelined(names: list[str], layouts: list[dict]) -> list | None:
    results = [_run(name, LLMParallelStrategy(**layout), devices=2) for name in names for layout in layouts]
    return results if dist.get_rank() == 0 else None


@pytest.mark.timeout(900)
def test_tuple_and_model_output_blocks_pipeline_like_one_process():
    results = run_distributed(_pipelined, 2, MODELS, list(LAYOUTS.values()), timeout=840)[0]
    cases = [(name, label) for name in MODELS for label in LAYOUTS]
    for (name, label), result in zip(cases, results):
        reference = _run(name)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(result[0], reference[0]))
        param_diff = max((result[1][k] - v).norm() / v.norm() for k, v in reference[1].items())
        print(f"{name} {label}: max relative loss diff {loss_diff:.1e}, param diff {param_diff:.1e}")
        assert_parity(result, reference, f"{name} {label}")
