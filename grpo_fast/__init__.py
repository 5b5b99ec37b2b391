"""grpo_fast: the GRPO-family policy loss straight from hidden states, without the (tokens x vocab) logits.

The loss library (this package's top level; it imports nothing from the two below):
    variants      the registry of loss types (`LOSS_TYPES`), `LossConfig`, the per-token math and reductions
    logprobs      `token_logprobs`: per-token log-probs and entropies in chunks of the vocabulary
    loss          `grpo_loss` / `GRPOLoss`: the policy loss, fused (3 GEMM passes) or two-phase
    token_loss    `fused_token_loss`: your own token-separable loss inside the sweep (3 GEMM passes)
    sweep         what those three share: the checks and the masked-token compaction once (`prepare`), the
                  fused and the log-prob autograd Functions over the chunk loop
    options       the option groups `Execution` and `TokenWeights`, and the error of a keyword that moved
    kept          kept sets (top-k / top-p sampling): `KeptSet`, the CSR format, and its checks
    chunked       the chunk loop shared by all, and the d(weight) accumulation
    backends/     how a chunk is processed: PyTorch, the Triton kernels (`grpo_fast.kernels`), a vocabulary-
                  parallel head; their interface `ChunkOps` in backends/base
    numerics      `accumulation_dtype` and `LogitTransform`: the leaf the chunk loop, the backends, the checks
                  and the reference all import
    inputs        argument checks: every error names the argument, the expected and the actual value
    reference     the same loss from the full logits: the test oracle and the benchmark baseline
    models        final hidden states and LM-head parameters of Hugging Face causal LMs
    packed_attention  variable-length attention for packed rows: the trainer's micro-batches (and the TRL
                  drop-in's shared prompts) at memory linear in their tokens
    integrations/ drop-ins for TRL's GRPOTrainer, Liger's fused linear GRPO loss, verl's and OpenRLHF's actors

Built on it:
    train/        the trainer (`grpo_fast.train.train`, `TrainConfig`, `load_config`) and the memory planner
    benchmarks    the harness behind `grpo-fast bench` / `demo`, the GPU check, and profiling (GEMM counting, peak
                  memory) for the benchmarks and tests (from benchmarks/)
    cli           the `grpo-fast` command: train, eval, export, plan, bench, demo
"""

from grpo_fast.kept import KeptSet
from grpo_fast.logprobs import token_logprobs
from grpo_fast.loss import GRPOLoss, grpo_loss
from grpo_fast.numerics import LogitTransform
from grpo_fast.options import Execution, TokenWeights
from grpo_fast.token_loss import TokenChunk, autograd_token_loss, fused_token_loss
from grpo_fast.variants import LOSS_TYPES, LossConfig

__version__ = "0.1.0"
__all__ = ["token_logprobs", "grpo_loss", "GRPOLoss", "LossConfig", "LOSS_TYPES", "LogitTransform", "KeptSet",
           "Execution", "TokenWeights", "fused_token_loss", "autograd_token_loss", "TokenChunk"]
