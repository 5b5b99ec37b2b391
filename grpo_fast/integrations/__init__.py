"""Drop-ins for existing trainers and loss modules, each importing its peer only when imported itself:

- trl: `FastGRPOTrainer` (TRL's GRPOTrainer with grpo_fast's log-probs and fused loss), `patch_grpo_trainer`.
- liger: `FusedLinearGRPOLoss`, Liger's fused linear GRPO loss signature on grpo_fast.
- verl: verl 0.9's actor (loaded by `external_lib`): grpo_fast's log-probs, the actor loss fused in the sweep;
  verl_cpu, verl's device layer on a CPU host (tests, benchmarks, `main_ppo` on a CPU).
- vllm_cpu: a vLLM plugin (the package's vllm.general_plugins entry point) for CPU hosts, inert unless asked:
  weight pushes into vLLM's CPU engine, per-prompt seeds for reproducible rollouts.
- openrlhf: OpenRLHF 0.11's actor step, its actor and loss calls one fused pass.
- attention: variable-length attention for transformers' decoders over packed rows (flash-attention 2 or sdpa per
  sequence, each group's prompt once), used by the TRL drop-in and the trainer.
"""


def peer_import_error(error: ImportError, adapter: str, *, peer: str, package: str, install: str,
                      dependencies: str) -> ImportError:
    """The ImportError the adapter module `adapter` raises when importing its peer raised `error`.

    A module missing outside the peer's own package (`error.name`, say 'codetiming' under verl) is one of the peer's
    dependencies, which installing the peer may not bring (verl and OpenRLHF install without theirs): the message
    names it and says how to install those (`dependencies`). The peer missing, a module of its own missing (another
    release) or any other ImportError gives the message to install the peer, `install`. peer: the peer in words;
    package: its top-level module.
    """
    missing = error.name if isinstance(error, ModuleNotFoundError) else None
    if missing and missing.partition(".")[0] != package:
        return ImportError(f"{adapter}: {peer} imports {missing!r}, which is not installed: a dependency of {peer} "
                           f"is missing ({dependencies})")
    return ImportError(install)
