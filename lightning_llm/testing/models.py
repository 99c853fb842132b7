"""Small LightningModules that look like what users bring, for tests and benchmarks.

* :class:`HFCausalLM` wraps a Hugging Face causal LM built from a tiny config (random init,
  nothing downloaded): ``LlamaForCausalLM`` or ``GPT2LMHeadModel``.
* :class:`UserLM` is a hand-written decoder whose attention is plain ``nn.Linear`` layers with
  names of its own (``query``/``key``/``value``/``proj``, ``fc_in``/``fc_out``) and which reshapes
  with a stored head count, as much user code does.

All take (batch, seq_len + 1) token batches like :class:`~lightning_llm.models.CausalLM` and train
with SGD + momentum. Parity tests compare parameters after many steps: Adam divides each gradient
by its own running magnitude, so an element whose true gradient is ~0 (a key bias, say) moves by a
full learning rate in the direction of its rounding noise, and two correct runs that sum in a
different order drift apart. SGD keeps the comparison sharp and also catches a gradient that is off
by a constant factor, which Adam's normalisation would hide.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class _NextTokenModule(L.LightningModule):
    """Shared training loop: next-token cross-entropy, SGD with momentum at a fixed learning rate."""

    def __init__(self, learning_rate: float = 0.5) -> None:
        super().__init__()
        self.learning_rate = learning_rate

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.logits(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)


class HFCausalLM(_NextTokenModule):
    """A Hugging Face ``LlamaForCausalLM`` (``arch="llama"``) or ``GPT2LMHeadModel`` (``arch="gpt2"``), tiny."""

    def __init__(
        self,
        arch: str = "llama",
        vocab_size: int = 256,
        hidden: int = 64,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        learning_rate: float = 0.5,
    ) -> None:
        super().__init__(learning_rate)
        import transformers

        if arch == "llama":
            config = transformers.LlamaConfig(
                vocab_size=vocab_size,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                max_position_embeddings=512,
                attn_implementation="sdpa",
            )
            self.model = transformers.LlamaForCausalLM(config)
        elif arch == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=vocab_size,
                n_embd=hidden,
                n_layer=layers,
                n_head=heads,
                n_positions=512,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                attn_implementation="sdpa",
            )
            self.model = transformers.GPT2LMHeadModel(config)
        else:
            raise ValueError(f"arch={arch!r}; use 'llama' or 'gpt2'.")

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


class _UserAttention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.num_heads, -1).transpose(1, 2) for lin in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class _UserBlock(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = _UserAttention(width, num_heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln2(x))))


class UserLM(_NextTokenModule):
    """A user-style GPT: learned positions, LayerNorm, plain Linear attention with its own names."""

    def __init__(
        self,
        vocab_size: int = 256,
        width: int = 64,
        layers: int = 2,
        num_heads: int = 4,
        max_len: int = 256,
        learning_rate: float = 0.5,
    ) -> None:
        super().__init__(learning_rate)
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(_UserBlock(width, num_heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self(tokens)
