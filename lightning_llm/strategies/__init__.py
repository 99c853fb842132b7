"""Lightning strategies: LLMParallelStrategy (native torch) and LLMDeepSpeedStrategy."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_llm.strategies.parallel import LLMParallelStrategy

LLMParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["LLMParallelStrategy"]
