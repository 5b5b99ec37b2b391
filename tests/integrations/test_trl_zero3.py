"""FastGRPOTrainer under DeepSpeed ZeRO-3 against GRPOTrainer under ZeRO-3: the LM head stays partitioned over 2
ranks, the fused loss gathers it inside the model's forward and its gradient reaches each rank's partition (two
CPU processes under torchrun, gloo; each case in fresh processes, see zero3_parity.py)."""

import json

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("trl")

from tests.helpers import torchrun_json  # noqa: E402

CASES = {
    # fused (3 GEMM passes), with the reference's and old log-probs through grpo_fast's head
    "dapo_kl_num_iterations": dict(beta=0.04, num_iterations=2),
    # two phases: the backward recomputes the logits, with the head gathered again by ZeRO-3
    "gspo_clipped": dict(importance_sampling_level="sequence", loss_type="grpo", num_iterations=2, epsilon=3e-4,
                         epsilon_high=4e-4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero3_matches_grpo_trainer(name, tmp_path):
    result = torchrun_json("tests.integrations.zero3_parity", str(tmp_path), json.dumps(CASES[name]))
    assert result["head_partitioned"], "the LM head was not split into ZeRO-3 partitions: the test shows nothing"
    assert result["fused_loss_calls"] > 0 and result["fallback_reasons"] == []
    for key in result["expected"][0]:
        torch.testing.assert_close(torch.tensor([e[key] for e in result["actual"]]),
                                   torch.tensor([e[key] for e in result["expected"]]), rtol=1e-4, atol=1e-7, msg=key)
    assert result["head_moved"] > 1e-4, "the head did not train: its gradient did not reach the partitions"
    assert result["weight_diff"] < 1e-4
