"""Optimizers that know the strategy's layouts: :class:`ShardedMuon` and its parameter split."""

from lightning_llm.optim.muon import ShardedMuon, muon_param_groups, newton_schulz

__all__ = ["ShardedMuon", "muon_param_groups", "newton_schulz"]
