"""Drop-ins for existing trainers and loss modules, each importing its peer only when imported itself:

- trl: `FastGRPOTrainer` (TRL's GRPOTrainer with grpo_fast's log-probs and fused loss), `patch_grpo_trainer`.
- liger: `FusedLinearGRPOLoss`, Liger's fused linear GRPO loss signature on grpo_fast.
- verl: verl 0.9's actor (loaded by `external_lib`): grpo_fast's log-probs, the actor loss fused in the sweep;
  verl_cpu, verl's device layer on a CPU host (tests, benchmarks).
- openrlhf: OpenRLHF 0.11's actor step, its actor and loss calls one fused pass.
"""
