"""The parity table of grpo_fast's fused verl loss: for each fused policy loss x loss_agg_mode, on the inputs of
test_verl.py (float64, both clamps active on some tokens, KL and entropy bonus on, several chunks), the absolute
loss error and the largest gradient error (hidden, weight and bias, relative to each gradient's largest entry)
of `fused_ppo_loss` against verl's `ppo_loss` on full logits. In verl's environment:

    python -m tests.integrations.verl_parity_table
"""

import torch

from grpo_fast import Execution
from grpo_fast.integrations import verl as gf_verl
from tests.integrations import test_verl as cases


def errors(loss_mode: str, agg_mode: str, vocab: int = 37, hidden_size: int = 16, temperature: float = 0.7):
    data = cases.micro_batch([3, 5, 2], [6, 1, 4], vocab, dtype=torch.float64)
    config = cases.actor_config(loss_mode, agg_mode)
    inputs = cases.packed_inputs(data, hidden_size, vocab, torch.float64)
    labels = inputs[3]
    expected_inputs = [tensor.clone().requires_grad_() for tensor in inputs[:3]]
    expected, _ = cases.verl_reference(*expected_inputs, labels, data, config, temperature, True)
    expected.backward()
    actual_inputs = [tensor.clone().requires_grad_() for tensor in inputs[:3]]
    actual = gf_verl.fused_ppo_loss(actual_inputs[0], actual_inputs[1], labels, data, config, bias=actual_inputs[2],
                                    temperature=temperature, with_entropy=True,
                                    execution=Execution(backend="torch", chunk_bytes=4 * 4 * vocab))[0]
    actual.backward()
    grad_error = max(((a.grad - e.grad).abs().max() / e.grad.abs().max()).item()
                     for a, e in zip(actual_inputs, expected_inputs))
    return abs(actual.item() - expected.item()), grad_error


def main():
    print("| loss_mode | " + " | ".join(cases.AGG_MODES) + " |")
    print("|---|" + "---|" * len(cases.AGG_MODES))
    for mode in sorted(cases.MODE_OPTIONS):
        cells = ["{:.0e} / {:.0e}".format(*errors(mode, agg)) for agg in cases.AGG_MODES]
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
