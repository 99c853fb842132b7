"""Multi-node launch: two torchrun launchers (2 "nodes" x 2 processes) meet by c10d rendezvous on loopback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_llm.testing.distributed import free_port
from tests.strategies._parity import assert_parity, train

ROOT = Path(__file__).parents[2]
SCRIPT = Path(__file__).with_name("_train_two_nodes.py")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_two_torchrun_nodes_train_dp2_x_tp2_like_one_process(tmp_path):
    out = tmp_path / "result.pt"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "two-nodes",
        "--max-restarts",
        "0",
        str(SCRIPT),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launchers = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    try:
        outputs = [launcher.communicate(timeout=540)[0] for launcher in launchers]
    finally:
        for launcher in launchers:  # a hung rendezvous or collective must not outlive the test
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    got = torch.load(out, weights_only=False)
    assert got["layout"]["num_nodes"] == 2 and got["layout"]["world_size"] == 4 and got["layout"]["tp"] == 2
    assert_parity((got["losses"], got["params"]), train("reference"), "2 nodes x 2 processes, dp2 x tp2")
    for rank in (0, 2):  # ranks (0, 1) and (2, 3) are tensor-parallel pairs
        pair = got["norms"][rank], got["norms"][rank + 1]
        assert pair[0].keys() == pair[1].keys() and pair[0]
        for name in pair[0]:
            assert torch.equal(pair[0][name], pair[1][name]), f"{name} differs between ranks {rank} and {rank + 1}"
