"""What LoRA adds to a decoder layer's saved activations (plan.memory.adapter_copies), against the bytes the
trainer's own adapted model saves for backward, counted by autograd's saved-tensor hooks: with a bf16 base PEFT's
fp32 adapters save an fp32 copy of each adapted layer's input; in fp32 and under bf16 autocast they add nothing."""

import copy

import pytest
import torch

pytest.importorskip("peft")

from grpo_fast.train import lora  # noqa: E402
from grpo_fast.train.plan.memory import Job, ModelShape, adapter_copies  # noqa: E402
from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from tests.helpers import flat_config  # noqa: E402

HIDDEN, HEADS, KV_HEADS, VOCAB, TOKENS, RANK = 256, 4, 2, 512, 512, 8
SHAPE = ModelShape(HIDDEN, 2 * HIDDEN, 2, HEADS, KV_HEADS, VOCAB, tie_word_embeddings=True, attention_bias=True)
MODES = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "bf16-autocast": (torch.float32, True)}


def saved_per_token_per_layer(dtype: str, lora_rank: int, load_in_4bit: bool = False) -> float:
    """Bytes a decoder layer saves for backward per token (the difference between 3 and 2 layers, parameters not
    counted), for the model the trainer builds: weights in `dtype`'s weights dtype, LoRA (and a 4-bit base)."""
    weights_dtype, autocast = MODES[dtype]
    counts = []
    for layers in (2, 3):
        model = tiny_qwen2(VOCAB, hidden_size=HIDDEN, num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS,
                           max_positions=TOKENS).to(weights_dtype)
        if lora_rank:
            policy = flat_config(lora_rank=lora_rank, load_in_4bit=load_in_4bit, sft_steps=0).policy
            model = lora.adapted(copy.deepcopy(model), policy, weights_dtype)
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
        decoder = model.get_base_model().model if lora_rank else model.model
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                decoder(input_ids=ids)
        counts.append(sum(saved.values()))
    return (counts[1] - counts[0]) / TOKENS


@pytest.mark.parametrize("dtype", list(MODES))
def test_adapter_copies_are_what_the_adapted_layers_save(dtype):
    added = saved_per_token_per_layer(dtype, RANK) - saved_per_token_per_layer(dtype, 0)
    planned = adapter_copies(SHAPE, Job(dtype=dtype, lora_rank=RANK))
    if dtype == "bf16":
        # seven fp32 copies of 2048 inputs, less the 1280 bf16 inputs the frozen base layers no longer save:
        # measured within 10%, never above the plan
        assert planned == 4 * (2048 + 7 * RANK) - 2 * 1280
        assert 0.9 * planned < added <= planned, (added, planned)
    else:
        assert planned == 0 and added <= 0, added          # no copy: LoRA saves no more than full training
    assert adapter_copies(SHAPE, Job(dtype=dtype)) == 0


def test_a_4bit_base_adds_the_same_copies():
    pytest.importorskip("bitsandbytes")
    added = saved_per_token_per_layer("bf16", RANK, load_in_4bit=True) - saved_per_token_per_layer("bf16", 0)
    planned = adapter_copies(SHAPE, Job(dtype="bf16", lora_rank=RANK, load_in_4bit=True))
    assert 0.9 * planned < added <= planned, (added, planned)
