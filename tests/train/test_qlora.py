"""QLoRA (policy.load_in_4bit): LoRA on a base quantized to NF4 by bitsandbytes, on this CPU. The adapters'
gradients against LoRA on the dequantized base, what engines and exports get, the config's refusals, and a run
that trains, resumes, exports (merged or adapters alone) and evaluates."""

import copy
import json
import os
import re

import pytest
import torch
from torch import nn

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from grpo_fast.train import lora, qlora  # noqa: E402
from grpo_fast.train.loop import train  # noqa: E402
from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from tests.helpers import flat_config  # noqa: E402

QUIET = dict(log_completions=0, eval_every=0, save_every=1)


def qlora_keys(**keys) -> dict:
    return {"lora_rank": 4, "load_in_4bit": True, "sft_steps": 0, **keys}


def adapted_pair(double_quant: bool):
    """(LoRA on the 4-bit base, LoRA on that base dequantized into plain nn.Linear layers): the same adapters, B
    drawn away from PEFT's zeros so that they matter."""
    policy = flat_config(**qlora_keys(bnb_4bit_double_quant=double_quant)).policy
    model = tiny_qwen2(300, seed=0)
    quantized = qlora.quantize_base(copy.deepcopy(model), policy, torch.float32)
    plain = copy.deepcopy(model)
    for name, module in quantized.named_modules():
        if qlora.is_4bit(module):
            plain.get_submodule(name).weight.data.copy_(qlora.dequantized(module))
    pair = []
    for base in (quantized, plain):
        torch.manual_seed(0)
        adapted = lora.add_adapters(base, policy)
        with torch.no_grad():
            for parameter_name, parameter in adapted.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(parameter_name)))
        pair.append(adapted)
    return pair


@pytest.mark.parametrize("double_quant", [False, True])
def test_lora_gradients_on_the_4bit_base_are_those_on_its_dequantized_weights(double_quant):
    quantized, plain = adapted_pair(double_quant)
    layer = quantized.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert qlora.is_4bit(layer) and layer.weight.dtype == torch.uint8       # really 4-bit: packed, 2 a byte
    assert layer.weight.numel() == 128 * 128 // 2
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (quantized, plain):
        model.zero_grad()
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 300), ids[:, 1:].reshape(-1)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * 2     # A and B, 7 targets, 2 layers
    for name, grad in grads[0].items():
        reference = grads[1][name]
        assert reference.norm() > 0, name
        assert (grad - reference).norm() <= 1e-4 * reference.norm(), name
    # the base's weights did not get gradients, nor change: frozen in 4 bits
    assert not any(p.requires_grad for n, p in quantized.named_parameters() if ".lora_" not in n)


def test_engines_and_exports_get_the_dequantized_base_with_the_adapters_merged():
    quantized, plain = adapted_pair(double_quant=False)
    merged, reference = lora.engine_weights(quantized), lora.engine_weights(plain)
    assert merged.keys() == reference.keys() and not any("absmax" in name or "quant" in name for name in merged)
    for name, tensor in merged.items():
        assert tensor.dtype == reference[name].dtype and torch.allclose(tensor, reference[name], atol=1e-6), name
    # a plain model loaded with them computes the policy's logits
    model = tiny_qwen2(300, seed=0)
    model.load_state_dict(merged)
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(model(input_ids=ids).logits, quantized(input_ids=ids).logits, atol=1e-4)


def test_the_planner_counts_4bit_weights_with_their_scales():
    from grpo_fast.train.plan.memory import Job, ModelShape, plan

    shape = ModelShape(1024, 2816, 12, 16, 4, 32000)
    base = dict(prompt_length=64, completion_length=64, dtype="bf16", lora_rank=16, engine="hf")
    full, four = plan(shape, Job(**base))["weights"], plan(shape, Job(**base, load_in_4bit=True))["weights"]
    linear = shape.num_layers * sum(a * b for a, b in shape.linear_shapes())
    assert full - four == pytest.approx(linear * 2 - qlora.quantized_bytes(linear, False), abs=1)
    double = plan(shape, Job(**base, load_in_4bit=True, bnb_4bit_double_quant=True))["weights"]
    assert four - double == pytest.approx(linear * (4 / 64 - 1 / 64 - 4 / 64 / 256), abs=1)
    # what bitsandbytes holds for one layer: its packed weights and its quantization state
    layer = nn.Sequential(nn.Linear(1024, 2816, bias=False), nn.Linear(2816, 8))
    layer.get_output_embeddings = lambda: layer[1]                  # the head stays as it is
    qlora.quantize_base(layer, flat_config(**qlora_keys()).policy, torch.bfloat16)
    assert type(layer[1]) is nn.Linear
    weight = layer[0].weight
    held = weight.numel() * weight.element_size() + weight.quant_state.absmax.numel() * 4
    assert held == qlora.quantized_bytes(1024 * 2816, False)


@pytest.mark.parametrize("keys, words", [
    ({"lora_rank": 0}, "load_in_4bit freezes the base in 4 bits and trains LoRA adapters on it, but lora_rank is 0"),
    ({"sft_steps": 5}, "load_in_4bit: the warm start (sft_steps 5) trains the whole base"),
    ({"distributed": "fsdp2"}, "load_in_4bit with distributed 'fsdp2'"),
    ({"load_in_4bit": False, "bnb_4bit_double_quant": True}, "bnb_4bit_double_quant quantizes the 4-bit base's "
                                                             "scales, but load_in_4bit is false")])
def test_what_a_4bit_base_cannot_take_is_refused_in_one_line(keys, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        flat_config(**qlora_keys(**keys))


def test_a_qlora_run_trains_resumes_exports_and_evaluates(tmp_path):
    """Three steps of the built-in job with a 4-bit base (and the HF engine sampling from it); a run stopped after
    two and resumed ends where the three-step run ends; the export is the dequantized base with the adapters merged
    (the policy's log-probs), or with --peft-adapter the adapters alone; `grpo-fast eval` reads the export."""
    from grpo_fast.train.saved import eval_command
    from grpo_fast.train.saved.export import export_run

    keys = qlora_keys(max_steps=3, group_size=4, prompts_per_step=4, learning_rate=0.05, **QUIET)
    whole = train(flat_config(**keys, output_dir=str(tmp_path / "whole")), log=lambda *_: None)
    assert [r["step"] for r in whole] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in whole)
    train(flat_config(**{**keys, "max_steps": 2}, output_dir=str(tmp_path / "cut")), log=lambda *_: None)
    resumed = train(flat_config(**keys, output_dir=str(tmp_path / "cut")), resume=True, log=lambda *_: None)
    assert [r["step"] for r in resumed] == [3] and resumed[0]["loss"] == whole[2]["loss"]

    exported = export_run(str(tmp_path / "whole"), str(tmp_path / "export"), adapter=True, log=lambda *_: None)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(exported)
    assert all(type(m) is not bnb.nn.Linear4bit for m in merged.modules())
    with open(os.path.join(exported, "config.json")) as f:
        assert "quantization_config" not in json.load(f)            # a plain 16-bit model
    assert os.path.isfile(os.path.join(exported, "adapter", "adapter_model.safetensors"))
    final = whole and os.path.join(str(tmp_path / "whole"), "model")
    again = AutoModelForCausalLM.from_pretrained(final)
    ids = torch.randint(0, merged.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(merged(input_ids=ids).logits, again(input_ids=ids).logits, atol=1e-5)
    record = eval_command.main(str(tmp_path / "whole"), {"eval_prompts": 5}, log=lambda *_: None)
    assert record["problems"] == 5 and 0 <= record["accuracy"] <= 1


RESIDENT_AFTER_QUANTIZING = """
import gc, json, sys, torch
from grpo_fast.benchmarks.profiling import rss_bytes
import bitsandbytes, peft  # noqa: F401  (their libraries before the baseline)
from grpo_fast.train import qlora
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.policy import from_pretrained
before = rss_bytes()
model = from_pretrained(sys.argv[1], torch.float32)
weights = sum(p.numel() * p.element_size() for p in model.parameters())
qlora.quantize_base(model, TrainConfig.from_keys(lora_rank=8, load_in_4bit=True, sft_steps=0).policy, torch.float32)
gc.collect()
print(json.dumps({"fp32_weights": weights, "resident": rss_bytes() - before,
                  "held": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


def test_quantizing_a_loaded_checkpoint_leaves_its_16bit_weights_nowhere_resident():
    """SmolLM2-135M-Instruct loaded as the trainer loads it (transformers maps the checkpoint's file into memory),
    then quantized: what stays resident is about what the model holds (the NF4 layers, the fp32 embeddings and
    norms), not the 0.5 GiB of fp32 weights whose pages the quantization read through the mapping."""
    import subprocess
    import sys

    from grpo_fast.train import pretrained

    try:
        folder = pretrained.model_folder(pretrained.SMOLLM2)
    except ModuleNotFoundError as missing:
        pytest.skip(f"the real model is not installed: {missing}")
    done = subprocess.run([sys.executable, "-c", RESIDENT_AFTER_QUANTIZING, folder], capture_output=True, text=True,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    assert sizes["held"] < sizes["fp32_weights"] / 2
    assert sizes["resident"] < sizes["held"] + 0.1 * sizes["fp32_weights"], sizes
