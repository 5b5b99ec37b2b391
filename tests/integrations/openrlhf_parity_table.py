"""The parity table of grpo_fast's fused OpenRLHF step: for each policy-loss setting x KL setting of
test_openrlhf.py (a float64 tiny Qwen2, one log-ratio past PolicyLoss's clamp), the largest gradient error
(relative to each parameter gradient's largest entry) and the largest relative error of the logged metrics of
the patched `training_step` against OpenRLHF's own. In OpenRLHF's environment:

    python -m tests.integrations.openrlhf_parity_table
"""


# test_openrlhf first: it puts the flash-attn stand-in on sys.path, which importing openrlhf needs
from tests.integrations import test_openrlhf as cases
from tests.integrations.test_openrlhf import ActorPPOTrainer, gf_openrlhf

KL_SETTINGS = {"k3": dict(estimator="k3", unbiased=False), "k1, unbiased gradient": dict(estimator="k1",
                                                                                         unbiased=True),
               "no KL": dict(kl_coef=None)}


def errors(options: dict, trainer_options: dict):
    expected_status, expected = cases.run(gf_openrlhf._original_training_step, options, **trainer_options)
    actual_status, actual = cases.run(ActorPPOTrainer.training_step, options, **trainer_options)
    grad_error = max(((actual[name] - grad).abs().max() / grad.abs().max()).item() for name, grad in expected.items())
    metric_error = 0.0
    for key, value in expected_status["metrics"].items():
        value, mine = float(value), float(actual_status["metrics"][key])
        metric_error = max(metric_error, abs(mine - value) / max(abs(value), 1e-12))
    return grad_error, metric_error


def main():
    print("| policy loss | " + " | ".join(KL_SETTINGS) + " |")
    print("|---|" + "---|" * len(KL_SETTINGS))
    for name in sorted(cases.CASES):
        cells = ["{:.0e} / {:.0e}".format(*errors(cases.CASES[name], kl)) for kl in KL_SETTINGS.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
