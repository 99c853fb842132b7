"""ShardedMuon on one process: torch's own Muon and AdamW are the oracles, step for step, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llm.optim import ShardedMuon, muon_param_groups, newton_schulz

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs a newer torch")


@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (12, 12)])
def test_newton_schulz_is_torchs_iteration(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz  # torch's private function is the oracle

    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    want = _zeropower_via_newtonschulz(matrix, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(newton_schulz(matrix), want)


def test_float32_iteration_orthogonalizes():
    """In fp32 the quintic iteration maps every singular value into its known band (about 0.68 to 1.13)."""
    matrix = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    singular = torch.linalg.svdvals(newton_schulz(matrix, dtype=torch.float32))
    assert singular.min() > 0.6 and singular.max() < 1.2, singular


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.hidden = nn.Linear(8, 12)
        self.out = nn.Linear(12, 20, bias=False)

    def forward(self, ids):
        return self.out(torch.relu(self.hidden(self.embed(ids))))


def test_groups_split_hidden_matrices_from_embeddings_head_and_vectors():
    model = Tiny()
    muon, adamw = muon_param_groups(model, adamw_lr=1e-3)
    assert [p for p in muon["params"]] == [model.hidden.weight]
    assert {id(p) for p in adamw["params"]} == {id(model.embed.weight), id(model.hidden.bias), id(model.out.weight)}
    assert adamw["use_muon"] is False and adamw["lr"] == 1e-3


def test_steps_equal_torch_muon_and_adamw():
    torch.manual_seed(0)
    model, reference = Tiny(), Tiny()
    reference.load_state_dict(model.state_dict())
    mine = ShardedMuon(muon_param_groups(model, adamw_lr=1e-2, betas=(0.9, 0.95)), lr=0.02, weight_decay=0.1)
    theirs_muon = torch.optim.Muon([reference.hidden.weight], lr=0.02, weight_decay=0.1)
    others = [reference.embed.weight, reference.hidden.bias, reference.out.weight]
    theirs_adamw = torch.optim.AdamW(others, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    ids = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(2))
    for _ in range(4):
        for net in (model, reference):
            net(ids).logsumexp(-1).mean().backward()
        mine.step()
        theirs_muon.step()
        theirs_adamw.step()
        for optimizer in (mine, theirs_muon, theirs_adamw):
            optimizer.zero_grad()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_non_matrices_in_a_muon_group_are_refused_naming_their_shapes():
    with pytest.raises(ValueError, match=r"2-D matrices only, got shapes \[\(12,\)\].*use_muon=False"):
        ShardedMuon(Tiny().hidden.parameters())


def test_plan_counts_one_state_for_muon_matrices_and_two_for_the_adamw_group():
    from lightning_llm.modeling.optimizer_state import optimizer_states
    from lightning_llm.models import CausalLM, LlamaConfig

    class MuonLM(CausalLM):
        def configure_optimizers(self):
            return ShardedMuon(muon_param_groups(self), lr=0.02)

    module = MuonLM(LlamaConfig.from_name("tiny", n_layers=2))
    module.configure_model()
    # Hand count: q, k, v, o, gate, up, down of each block take Muon's momentum; the rest AdamW's two moments.
    config = module.config
    kv = config.n_kv_heads * config.dim // config.n_heads
    hidden = config.n_layers * (
        2 * config.dim * config.dim + 2 * kv * config.dim + 3 * config.dim * config.ffn_hidden_dim
    )
    total = sum(p.numel() for p in module.parameters())
    measured = optimizer_states(module)
    assert measured.names == ("ShardedMuon",)
    assert measured.states == pytest.approx((hidden + 2 * (total - hidden)) / total, rel=1e-12)
    # And a real step's state tensors hold that many elements.
    optimizer = module.configure_optimizers()
    module.log = lambda *args, **kwargs: None
    module.training_step(torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0)), 0).backward()
    optimizer.step()
    held = sum(t.numel() for state in optimizer.state.values() for t in state.values() if t.dim() > 0)
    assert held == hidden + 2 * (total - hidden)
