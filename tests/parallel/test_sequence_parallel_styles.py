"""Sequence parallelism with every style a block part can end in, against one process.

Under SP the residual stream is a sequence-sharded DTensor. Each model below has a block whose part ends in a
different style: a row split (the usual case, a DTensor back on the stream), a gathered column split closed by
an input-split row layer (Hugging Face's gathered plans), a gathered column split closed by a whole layer (a
plain full-sequence tensor), a part kept whole (plain weights fed a gathered sequence), a fused gate|up split,
a per-head norm summing its gradient inside the region, an embedding split along its width, and a parameter-free
sin/cos position table added to the embeddings (XGLM's; under SP it met the sharded stream whole and crashed). Each trains
under tp2 and tp2+SP (fp32, 4 steps): per-step loss and every parameter within 1e-5 relative of one process (2e-5
for the gathered split closed whole, whose rows sum in another order),
every parameter identical on the ranks holding it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity
from tests.zoo._harness import train
from tests.zoo._models import BUILDERS, VOCAB

WIDTH, HEADS = 32, 4

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


class _Attention(nn.Module):
    def __init__(self, head_norm: bool) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o_proj = nn.Linear(WIDTH, WIDTH)
        self.q_norm = nn.RMSNorm(WIDTH // HEADS) if head_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = lambda t: t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # noqa: E731
        q = heads(self.q_proj(x))
        q = self.q_norm(q) if self.q_norm is not None else q
        out = F.scaled_dot_product_attention(q, heads(self.k_proj(x)), heads(self.v_proj(x)), is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class _MLP(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.up = nn.Linear(WIDTH, 4 * WIDTH if fused else 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class _Block(nn.Module):
    def __init__(self, fused: bool, head_norm: bool) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), _Attention(head_norm)
        self.norm2, self.mlp = nn.LayerNorm(WIDTH), _MLP(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Sinusoids(nn.Module):
    """fairseq's (and XGLM's) positions: a fixed sin/cos table, a buffer, looked up by position."""

    def __init__(self, length: int = 64) -> None:
        super().__init__()
        angles = torch.arange(length)[:, None] / 10_000 ** (torch.arange(WIDTH // 2) / (WIDTH // 2))
        self.register_buffer("table", torch.cat([angles.sin(), angles.cos()], dim=1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[: ids.shape[1]].expand(ids.shape[0], -1, -1)


class _Net(nn.Module):
    def __init__(self, fused: bool = False, head_norm: bool = False, positions: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.positions = _Sinusoids() if positions else None
        self.layers = nn.ModuleList(_Block(fused, head_norm) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.positions is not None:
            x = x + self.positions(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


MLP = "model.layers.*.mlp"
# case -> (builder, the strategy's plan and kept-whole parts; inference plans everything else)
CASES = {
    "row_split": (lambda: _Net(), {}),
    "gathered_then_input_split": (
        lambda: _Net(),
        {"plan": {f"{MLP}.up": "colwise_gather", f"{MLP}.down": "rowwise_split_input"}},
    ),
    "gathered_then_whole": (lambda: _Net(), {"plan": {f"{MLP}.up": "colwise_gather", f"{MLP}.down": "replicate"}}),
    "part_kept_whole": (lambda: _Net(), {"replicate": [MLP]}),
    "fused_gate_up": (lambda: _Net(fused=True), {"plan": {f"{MLP}.up": "fused_colwise:2"}}),
    "per_head_norm": (lambda: _Net(head_norm=True), {}),
    "embedding_width_split": (lambda: _Net(), {"plan": {"model.embed": "embedding_colwise"}}),
    "sinusoidal_positions": (lambda: _Net(positions=True), {}),
}
LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}}


def _register() -> None:
    BUILDERS.update({f"sp_{name}": build for name, (build, _) in CASES.items()})


def _train_cases(layouts: list[str], cases: list[str]) -> dict:
    import traceback

    import torch.distributed as dist

    from lightning_llm.strategies import LLMParallelStrategy

    _register()
    results = {}
    for layout in layouts:
        for case in cases:
            options = CASES[case][1]
            strategy = LLMParallelStrategy(
                **LAYOUTS[layout],
                tensor_parallel_plan=options.get("plan"),
                tensor_parallel_replicate=options.get("replicate"),
            )
            try:
                results[(layout, case)] = train(f"sp_{case}", strategy, devices=2)
            except Exception as error:
                results[(layout, case)] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}"
    return results if dist.get_rank() == 0 else None


_runs: dict = {}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_part_style_matches_single_process(layout, case):
    if not _runs:
        _runs.update(run_distributed(_train_cases, 2, list(LAYOUTS), list(CASES), timeout=540)[0])
    result = _runs[(layout, case)]
    assert not isinstance(result, str), f"{case} under {layout} failed:\n{result}"
    losses, params, differing, *_ = result
    _register()
    ref_losses, ref_params, *_ = train(f"sp_{case}")
    assert not differing, f"{case} {layout}: parameters differ between ranks holding them: {differing}"
    # A gathered split closed by a whole layer sums each row in another order than one process: its layer-1 norm
    # bias (a small tensor) ends 1.2e-5 apart under tp2 on torch 2.13 (measured); 2e-5 bounds that rounding.
    rtol = 2e-5 if case == "gathered_then_whole" else 1e-5
    assert_parity((losses, params), (ref_losses, ref_params), f"{case} {layout}", rtol=rtol, loss_rtol=1e-5)
