"""FastGRPOTrainer under DeepSpeed ZeRO-3 against GRPOTrainer under ZeRO-3: the LM head stays partitioned over 2
ranks, the fused loss gathers it inside the model's forward and its gradient reaches each rank's partition (two
CPU processes under torchrun, gloo; each case in fresh processes, see zero3_parity.py)."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("trl")

from tests.helpers import ROOT  # noqa: E402

CASES = {
    # fused (3 GEMM passes), with the reference's and old log-probs through grpo_fast's head
    "dapo_kl_num_iterations": dict(beta=0.04, num_iterations=2),
    # two phases: the backward recomputes the logits, with the head gathered again by ZeRO-3
    "gspo_clipped": dict(importance_sampling_level="sequence", loss_type="grpo", num_iterations=2, epsilon=3e-4,
                         epsilon_high=4e-4),
}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero3_matches_grpo_trainer(name, tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
               "-m", "tests.integrations.zero3_parity", str(tmp_path), json.dumps(CASES[name])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}            # two processes on the machine's cores
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["head_partitioned"], "the LM head was not split into ZeRO-3 partitions: the test shows nothing"
    assert result["fused_loss_calls"] > 0 and result["fallback_reasons"] == []
    for key in result["expected"][0]:
        torch.testing.assert_close(torch.tensor([e[key] for e in result["actual"]]),
                                   torch.tensor([e[key] for e in result["expected"]]), rtol=1e-4, atol=1e-7, msg=key)
    assert result["head_moved"] > 1e-4, "the head did not train: its gradient did not reach the partitions"
    assert result["weight_diff"] < 1e-4
