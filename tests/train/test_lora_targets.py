"""LoRA targets are checked against the model before anything trains: a misspelt one is an error, not skipped."""

import pytest

pytest.importorskip("transformers")

from grpo_fast.train import lora  # noqa: E402
from grpo_fast.train.policy import tiny_qwen2  # noqa: E402


def test_a_misspelt_target_names_itself_and_the_models_layers():
    model = tiny_qwen2(64, num_layers=1)
    targets = ["q_proj", "vproj", "self_attn.o_proj"]
    message = (r"^lora_target_modules \['vproj'\] name no linear layer of the model; its linear layers are "
               r"\['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]$")
    with pytest.raises(ValueError, match=message):
        lora.check_target_modules(model, targets)
    lora.check_target_modules(model, ["q_proj", "self_attn.o_proj", "mlp.down_proj"])   # as PEFT matches
    with pytest.raises(ValueError, match=r"must not name the LM head \('lm_head'\)"):
        lora.check_target_modules(model, ["q_proj", "lm_head"])
    pytest.importorskip("peft")
    from tests.helpers import flat_config

    with pytest.raises(ValueError, match=message):            # PEFT alone would adapt q_proj and skip the typo
        lora.add_adapters(model, flat_config(lora_rank=2,
                                             lora_target_modules=["q_proj", "vproj", "self_attn.o_proj"]).policy)
