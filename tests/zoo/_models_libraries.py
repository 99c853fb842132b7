"""Model code from outside transformers and litgpt, as users bring it: tiny models built from each library's own API.

- ``torch_encoder``: a GPT written with PyTorch's own ``nn.TransformerEncoder`` (``nn.MultiheadAttention``: q/k/v in
  one ``in_proj_weight`` Parameter used through ``F.multi_head_attention_forward``, no Linear for them);
- ``x_transformers``: lucidrains' x-transformers ``TransformerWrapper`` + ``Decoder`` (each layer an
  ``nn.ModuleList`` of ``[norms, mixer, residual]`` slots, some ``None``, run from the stack's own forward);
- ``olmo_core``: AI2's OLMo-core pretraining codebase (blocks in an ``nn.ModuleDict`` keyed "0", "1", ...);
- ``mambapy``: a pure-PyTorch Mamba stack (``mambapy.mamba.Mamba``) inside the user's own embedding and head;
- ``retnet``: yet-another-retnet's ``RetNet`` (multi-scale retention, a linear-attention recurrence);
- ``palm``, ``palm_sdpa``: lucidrains' PaLM (palm-rlhf-pytorch): parallel attention and feed-forward blocks whose one
  ``fused_attn_ff_proj`` is cut by ``split(self.fused_dims)`` into q, one shared k and v head (multi-query) and the
  SwiGLU input, xPos rotary built from the local length, a pre-norm with a buffer; its default einsum attention, and
  ``flash_attn=True`` (SDPA).

Each builder seeds the global generator first, so one process and every rank build the same weights.
:func:`register` adds them to :data:`tests.zoo._models.BUILDERS` (``ZooLM(name)`` builds them by name); a library
that is not installed is left out of :data:`AVAILABLE` (``pip install -e '.[zoo]'`` installs them).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from tests.zoo._models import BUILDERS, VOCAB

DIM, HEADS, LAYERS, MAX_LEN = 32, 4, 2, 64


class TorchEncoderGPT(nn.Module):
    """A decoder-only GPT from ``nn.TransformerEncoder`` with a causal mask, as PyTorch's tutorials write it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_LEN, DIM)
        layer = nn.TransformerEncoderLayer(
            DIM, HEADS, dim_feedforward=2 * DIM, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))


class MambaLM(nn.Module):
    """The user's embedding and head around mambapy's Mamba stack (the library ships the stack, not an LM)."""

    def __init__(self) -> None:
        super().__init__()
        from mambapy.mamba import Mamba, MambaConfig

        self.embed = nn.Embedding(VOCAB, DIM)
        self.mamba = Mamba(MambaConfig(d_model=DIM, n_layers=LAYERS, d_state=8, pscan=True))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mamba(self.embed(tokens))))


class RetNetLM(nn.Module):
    """yet-another-retnet's RetNet, called for logits (its own ``forward`` computes a loss from labels)."""

    def __init__(self) -> None:
        super().__init__()
        from yet_another_retnet.retnet import RetNet

        self.retnet = RetNet(VOCAB, d_model=DIM, nhead=HEADS, num_layers=LAYERS, dropout=0.0, dim_feedforward=2 * DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.retnet.forward_parallel(tokens)


def _x_transformers() -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    layers = Decoder(dim=DIM, depth=LAYERS, heads=HEADS, rotary_pos_emb=True)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_LEN, attn_layers=layers, use_abs_pos_emb=False)


def _olmo_core() -> nn.Module:
    from olmo_core.nn.transformer import TransformerConfig

    config = TransformerConfig.llama_like(
        d_model=DIM, vocab_size=VOCAB, n_layers=LAYERS, n_heads=HEADS, hidden_size_multiple_of=16
    )
    model = config.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    return model


def _palm(flash: bool):
    def build() -> nn.Module:
        from palm_rlhf_pytorch import PaLM

        return PaLM(num_tokens=VOCAB, dim=DIM, depth=LAYERS, dim_head=DIM // HEADS, heads=HEADS, flash_attn=flash)

    return build


def _seeded(build):
    def seeded():
        torch.manual_seed(0)
        return build()

    return seeded


LIBRARIES = {  # model name -> (the module to import, the builder)
    "torch_encoder": ("torch", TorchEncoderGPT),
    "x_transformers": ("x_transformers", _x_transformers),
    "olmo_core": ("olmo_core", _olmo_core),
    "mambapy": ("mambapy", MambaLM),
    "retnet": ("yet_another_retnet", RetNetLM),
    "palm": ("palm_rlhf_pytorch", _palm(flash=False)),
    "palm_sdpa": ("palm_rlhf_pytorch", _palm(flash=True)),
}
AVAILABLE = [name for name, (package, _) in LIBRARIES.items() if importlib.util.find_spec(package) is not None]


def register() -> None:
    """Make the installed libraries' models buildable by name through the zoo harness (``ZooLM(name)``)."""
    BUILDERS.update({name: _seeded(LIBRARIES[name][1]) for name in AVAILABLE})
