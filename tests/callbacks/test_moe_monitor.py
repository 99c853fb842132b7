"""MoEMonitor against a brute-force count of the routes, in one process and under expert parallelism."""

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from lightning_llm.callbacks import MoEMonitor
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
from tests._wandb_file import read_when

STEPS, EVERY, BATCH = 4, 2, 8
CONFIG = LlamaConfig.from_name("tiny-moe", vocab_size=64, n_layers=3, n_dense_layers=1, moe_aux_loss_coef=0.01)


class _Recorded(MoEMonitor):
    def __init__(self):
        super().__init__()
        self.history = []

    def metrics(self, trainer):
        self.history.append(super().metrics(trainer))
        return self.history[-1]


class _Routes(L.Callback):
    """The oracle's input: every training forward's top-k expert ids per MoE layer, read from the router."""

    def __init__(self):
        self.routes = []

    def on_fit_start(self, trainer, pl_module):
        for layer in pl_module.model.layers[CONFIG.n_dense_layers :]:
            router = layer.feed_forward.router
            router.register_forward_hook(lambda m, args, out, layer=layer: self.routes.append((layer, out[1].clone())))


def _fit(strategy="auto", devices=1, per_rank=BATCH, callbacks=(), config=CONFIG, logger=False):
    torch.manual_seed(0)
    module = CausalLM(config, learning_rate=1e-3, warmup_steps=1)
    module.configure_model()  # built here, so every layout starts from these weights (the strategy keeps them)
    monitor = _Recorded()
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        log_every_n_steps=EVERY,
        callbacks=[monitor, *callbacks],
        logger=logger,
    )
    tokens = torch.randint(0, 64, (BATCH * STEPS, 33), generator=torch.Generator().manual_seed(1))
    # A distributed run's training loader gets Lightning's shuffling DistributedSampler (seed 0); one process gets
    # the same order from the same sampler over one replica.
    sampler = DistributedSampler(tokens, num_replicas=1, rank=0, shuffle=True) if devices == 1 else None
    trainer.fit(module, DataLoader(tokens, batch_size=per_rank, sampler=sampler))
    return monitor.history


def _brute_force(routes, layers, experts=4, loads=False):
    """max/mean load and the idle fraction per layer, per logging window, counted in Python (``loads``: every
    expert's routes over the mean instead)."""
    windows = []
    per_window = len(routes) // (STEPS // EVERY)
    for w in range(STEPS // EVERY):
        window = routes[w * per_window : (w + 1) * per_window]
        stats = []
        for layer in layers:
            ids = [i for lay, r in window if lay is layer for i in r.flatten().tolist()]
            counts = [ids.count(e) for e in range(experts)]
            if loads:
                stats.append([c / (sum(counts) / experts) for c in counts])
                continue
            stats.append((max(counts) / (sum(counts) / experts), sum(c == 0 for c in counts) / experts))
        windows.append(stats)
    return windows


def test_logged_load_equals_a_count_of_the_routers_choices():
    routes = _Routes()
    history = _fit(callbacks=[routes])
    layers = list(dict.fromkeys(layer for layer, _ in routes.routes))
    assert len(history) == STEPS // EVERY and len(layers) == 2
    for logged, expected in zip(history, _brute_force(routes.routes, layers)):
        names = [f"model.layers.{i}.feed_forward.experts" for i in (1, 2)]
        for name, (max_load, empty) in zip(names, expected):
            assert logged[f"moe/{name}/max_load"] == pytest.approx(max_load)
            assert logged[f"moe/{name}/empty_experts"] == pytest.approx(empty)
        assert logged["moe/max_load"] == pytest.approx(max(m for m, _ in expected))
        assert 0 < logged["moe/aux_loss"] < 1  # 2 layers x 0.01 x E * sum(f * P), about 0.02 when balanced


def test_wandb_gets_each_layers_expert_load_as_a_histogram(tmp_path, monkeypatch):
    """The histograms an offline W&B run wrote, read back from its file, hold the brute-force count's loads."""
    wandb = pytest.importorskip("wandb", reason="needs wandb: pip install 'lightning_llm[wandb]'")
    import json
    import re

    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    routes = _Routes()
    _fit(callbacks=[routes], logger=WandbLogger(project="moe", save_dir=str(tmp_path)))
    wandb.finish()
    layers = list(dict.fromkeys(layer for layer, _ in routes.routes))
    expected = _brute_force(routes.routes, layers, loads=True)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    keys = [re.escape(f"moe/model.layers.{layer}.feed_forward.experts/expert_load") for layer in (1, 2)]

    def found(written: str, key: str, field: str) -> list:
        # W&B's record holds a nested item per field: the key, the field name, then the field's JSON.
        pattern = key + r".{1,3}" + field + r".{1,4}?(\[[^\]]*\])"
        return [json.loads(v) for v in re.findall(pattern, written, flags=re.DOTALL)]

    def complete(data: bytes) -> bool:
        return all(len(found(data.decode("latin-1"), key, "bins")) >= 2 * len(expected) - 1 for key in keys)

    written = read_when(run_file, complete).decode("latin-1")
    for i, key in enumerate(keys):
        values, bins = found(written, key, "values"), found(written, key, "bins")
        # Each log writes a history item and then the summary's latest value: the same histogram twice in a row.
        values, bins = values[::2], bins[::2]
        assert len(values) == len(expected) and bins == [[0, 1, 2, 3, 4]] * len(expected), (key, values, bins)
        for logged, window in zip(values, expected):
            assert logged == pytest.approx(window[i]), (key, logged, window[i])


# Without the aux loss: it is computed per micro-batch, so data-parallel ranks would train the router differently
# from one process (as with any per-sample-group loss), and the routes would drift apart.
NO_AUX = LlamaConfig.from_name("tiny-moe", vocab_size=64, n_layers=3, n_dense_layers=1)


def _ep2():
    strategy = LLMParallelStrategy(expert_parallel_size=2, zero_stage=3)
    history = _fit(strategy, devices=2, per_rank=BATCH // 2, config=NO_AUX)
    return history if dist.get_rank() == 0 else None


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_expert_parallel_logs_the_global_batchs_load_as_one_process_does():
    """Each EP rank routes half the batch; averaged over the ranks, the load is the whole batch's."""
    one = _fit(config=NO_AUX)
    two = run_distributed(_ep2, 2, timeout=240)[0]
    assert len(one) == len(two) == STEPS // EVERY
    for a, b in zip(one, two):
        assert "moe/aux_loss" not in a and b == pytest.approx(a, rel=1e-6)
