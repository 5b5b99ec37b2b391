"""Runs vLLM's CPU linear dispatch with and without grpo_fast's plugin and prints what
tests/integrations/test_vllm_cpu_plugin.py checks, as JSON (a separate process: vLLM's import sets process state).
    GRPO_FAST_VLLM_CPU_PLAIN_LINEAR=1|0 python tests/integrations/vllm_cpu_plugin_check.py
"""

import json

import torch


def main() -> None:
    from vllm.model_executor.layers import utils

    from grpo_fast.integrations import vllm_cpu

    vllm_cpu.register()                                 # what vLLM's plugin loader calls in each of its processes
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    # bf16 with K % 32 == 0 and N % 16 == 0: the shapes vLLM's packed kernels take
    layer.weight = torch.nn.Parameter(torch.randn(64, 64, generator=generator).bfloat16(), requires_grad=False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    x = torch.randn(3, 64, generator=generator).bfloat16()
    result = {"weight_kept": layer.weight.numel() == 64 * 64}
    if result["weight_kept"]:
        new_weight = torch.randn(64, 64, generator=generator).bfloat16()
        layer.weight.data.copy_(new_weight)             # a weight sync loads into the parameter in place
        out = utils.cpu_unquantized_gemm(layer, x, layer.weight, None)
        result["follows_loaded_weight"] = torch.equal(out, torch.nn.functional.linear(x, new_weight))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
