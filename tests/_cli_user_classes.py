"""A user's own model and data module whose init arguments share names with CausalLM's and LLMDataModule's."""

import lightning as L

from lightning_llm.data import LLMDataModule


class UserModule(L.LightningModule):
    def __init__(self, learning_rate: float = 1e-3, warmup_steps: int = 7) -> None:
        super().__init__()
        self.save_hyperparameters()


class UserData(LLMDataModule):
    def __init__(self, seq_len: int = 32, batch_size: int = 3) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size)
