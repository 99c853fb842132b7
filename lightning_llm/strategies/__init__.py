"""Lightning strategies: LLMParallelStrategy (native torch) and LLMDeepSpeedStrategy."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_llm.strategies.deepspeed import LLMDeepSpeedStrategy
from lightning_llm.strategies.parallel import LLMParallelStrategy

LLMParallelStrategy.register_strategies(StrategyRegistry)
LLMDeepSpeedStrategy.register_strategies(StrategyRegistry)

__all__ = ["LLMDeepSpeedStrategy", "LLMParallelStrategy"]
