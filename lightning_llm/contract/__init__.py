"""The one interface between strategies and the callbacks / CLI that need to know how a run is laid out.

* :mod:`.protocol`: :class:`ParallelLayout` and the :class:`StrategyContract` protocol both of our strategies implement;
* :mod:`.lightning`: the same contract answered for Lightning's own strategies (single device, DDP, FSDP, DeepSpeed);
* :mod:`.resolution`: :func:`contract_of`, which picks one of the two for a trainer.

Example::

    from lightning_llm.contract import contract_of

    contract = contract_of(trainer)
    norm = contract.grad_norm()                      # global over every shard, stage and replica
    future = contract.save_checkpoint_async("ckpt")  # written in the background; .result() waits
"""

from lightning_llm.contract.protocol import ParallelLayout, StrategyContract, completed
from lightning_llm.contract.resolution import contract_of, implements_contract

__all__ = ["ParallelLayout", "StrategyContract", "completed", "contract_of", "implements_contract"]
