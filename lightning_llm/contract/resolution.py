"""Which :class:`~lightning_llm.contract.protocol.StrategyContract` answers for a trainer."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.strategies import Strategy

from lightning_llm.contract.lightning import LightningContract
from lightning_llm.contract.protocol import StrategyContract

# Every public member the protocol declares; a strategy implements the contract when its class has them all.
_MEMBERS = tuple(name for name in vars(StrategyContract) if not name.startswith("_"))


def contract_of(run: L.Trainer | Strategy) -> StrategyContract:
    """The trainer's strategy if it implements :class:`StrategyContract`, else a :class:`~lightning_llm.contract.lightning.LightningContract` for it.

    ``run`` may also be a strategy not attached to a trainer (yet): its :class:`~lightning_llm.contract.lightning.LightningContract` then answers
    only the members about how it checkpoints (``saves_to_urls`` and the like).

    Example::

        contract = contract_of(trainer)
        tokens_per_step = batch_tokens * contract.layout.dp
    """
    if isinstance(run, Strategy):
        return run if implements_contract(run) else LightningContract(strategy=run)
    strategy = run.strategy
    if implements_contract(strategy):
        return strategy
    return LightningContract(run)


def implements_contract(strategy: object) -> bool:
    """Whether ``strategy``'s class defines every member of :class:`StrategyContract`.

    Checked on the class, not the instance: ``isinstance(x, StrategyContract)`` reads each property, and
    a strategy's layout exists only once it is set up.
    """
    return all(hasattr(type(strategy), name) for name in _MEMBERS)
