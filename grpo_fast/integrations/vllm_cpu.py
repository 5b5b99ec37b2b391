"""A vLLM plugin for CPU hosts: an outside trainer's weight pushes reach vLLM's CPU engine, and its rollouts can be
drawn reproducibly.

vLLM's CPU backend packs each linear layer's weight into a oneDNN (or sgl-kernel) handle when the model loads and
empties `layer.weight`, or keeps a packed copy beside it: weights loaded later, as verl's weight sync loads them,
then fail ("Attempted to load weight ... into parameter (torch.Size([0]))") or are never read. With
`GRPO_FAST_VLLM_CPU_PLAIN_LINEAR=1` in the environment of vLLM's processes, this plugin (the package's
`vllm.general_plugins` entry point, which vLLM loads in each of its processes before the model) makes those layers
multiply with `torch.nn.functional.linear` on their own `weight`, which every load then updates. A CPU-only aid,
slower than the packed kernels: it does nothing unless the variable is set and vLLM's platform is the CPU, so no
GPU run ever reaches it.

With `GRPO_FAST_VLLM_SEED_BY_PROMPT=<seed>` too, each request that carries no seed of its own gets one from its
prompt's tokens, the seed and how many requests for the same prompt came before: a prompt's k samples are drawn
with the same k seeds whatever order the requests arrive in (an asynchronous server's batches vary from run to
run), so two runs sample the same completions, which lets two trainers' steps be compared on equal rollouts.
"""

import collections
import hashlib
import os

ENV = "GRPO_FAST_VLLM_CPU_PLAIN_LINEAR"
SEED_ENV = "GRPO_FAST_VLLM_SEED_BY_PROMPT"


def register() -> None:
    """vLLM's plugin hook: on a CPU platform, swaps vLLM's CPU linear dispatch for plain F.linear when ENV is "1",
    and seeds unseeded requests by prompt when SEED_ENV holds a seed."""
    plain_linear, seed = os.environ.get(ENV) == "1", os.environ.get(SEED_ENV)
    if not (plain_linear or seed):
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if seed:
        _seed_by_prompt(int(seed))
    if plain_linear:
        _plain_linear()


def _seed_by_prompt(seed: int) -> None:
    """InputProcessor.process_inputs gives an unseeded request the seed of (seed, its prompt's tokens, the number of
    earlier requests for that prompt)."""
    from vllm import SamplingParams
    from vllm.v1.engine import input_processor

    processor = input_processor.InputProcessor
    if getattr(processor.process_inputs, "seed_by_prompt", False):
        return
    original, seen = processor.process_inputs, collections.Counter()

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if isinstance(params, SamplingParams) and params.seed is None and token_ids is not None:
            digest = hashlib.sha256(f"{seed}:{list(token_ids)}".encode()).digest()
            params = params.clone()
            params.seed = (int.from_bytes(digest[:7], "little") + seen[digest]) % 2**62
            seen[digest] += 1
        return original(self, request_id, prompt, params, *args, **kwargs)

    process_inputs.seed_by_prompt = True
    processor.process_inputs = process_inputs


def _plain_linear() -> None:
    """vLLM's CPU linear dispatch (model load) leaves each linear layer multiplying its own weight with F.linear."""
    import torch
    from vllm.model_executor.layers import utils

    packed = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if packed is None or getattr(packed, "plain_linear", False):
        return

    def plain_linear(layer, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:                  # not a linear layer (a causal conv's weight): vLLM's own
            return packed(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    plain_linear.plain_linear = True
    utils.dispatch_cpu_unquantized_gemm = plain_linear
