"""grpo_fast.models on tiny Hugging Face models built from configs: log-probs equal the model's own logits'."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast.models import LMHead, final_hidden_states, lm_head

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def build(name, **extra):
    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(0)
    config = config_cls(**SMALL, **extra)
    return model_cls(config).eval()


MODELS = {
    "qwen2": lambda: build("Qwen2", tie_word_embeddings=False),
    "llama": lambda: build("Llama", tie_word_embeddings=False),
    "llama_tied": lambda: build("Llama", tie_word_embeddings=True),
    "gemma2_softcap": lambda: build("Gemma2", head_dim=8, final_logit_softcapping=5.0, query_pre_attn_scalar=8),
    "cohere_logit_scale": lambda: build("Cohere", logit_scale=0.4),
    "granite_logits_scaling": lambda: build("Granite", logits_scaling=3.0),
}


def check_matches_logits(model, temperature=1.0):
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 11), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0                                   # left padding
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        expected = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
        head = lm_head(model)
        hidden = final_hidden_states(model, input_ids, attention_mask)
        actual = gf.token_logprobs(hidden[:, :-1], head.weight, input_ids[:, 1:], bias=head.bias,
                                   transform=head.transform(temperature))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    return head


@pytest.mark.parametrize("name", sorted(MODELS))
def test_token_logprobs_from_hidden_states_equal_the_models_logits(name):
    model = MODELS[name]()
    head = check_matches_logits(model, temperature=0.8)
    if name == "gemma2_softcap":
        assert head.logit_softcap == 5.0
    if name == "cohere_logit_scale":
        assert head.logit_scale == pytest.approx(0.4)
    if name == "granite_logits_scaling":
        assert head.logit_scale == pytest.approx(1 / 3)
    if name == "llama_tied":
        assert head.weight is model.get_input_embeddings().weight


def test_peft_lora_model():
    peft = pytest.importorskip("peft")
    model = MODELS["qwen2"]()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    for name, param in lora.named_parameters():            # make the adapter non-trivial
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    head = check_matches_logits(lora)
    assert not head.weight.requires_grad                    # a frozen head: the fused loss skips its GEMM


def test_lora_on_the_head_itself_is_refused():
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(MODELS["llama"](), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(TypeError, match="PEFT adapter on the LM head"):
        lm_head(lora)


def test_frozen_head_loss_runs_two_passes_and_leaves_no_grad():
    from grpo_fast.benchmarks.profiling import GemmCounter

    model = MODELS["qwen2"]()
    head = lm_head(model)
    head.weight.requires_grad_(False)
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    hidden = final_hidden_states(model, input_ids)[:, :-1]
    mask = torch.ones(2, 8, dtype=torch.bool)
    with GemmCounter() as counter:
        loss, _ = gf.grpo_loss(hidden, head.weight, input_ids[:, 1:], torch.tensor([1.0, -1.0]), mask,
                               execution=gf.Execution(backend="torch"))
        torch.autograd.grad(loss, hidden)
    assert counter.flops == 2 * (2 * 16 * SMALL["hidden_size"] * SMALL["vocab_size"])
    assert head.weight.grad is None


def test_wrapped_model_is_unwrapped():
    model = MODELS["llama"]()
    wrapper = torch.nn.Module()
    wrapper.module = model
    assert isinstance(lm_head(wrapper), LMHead)
    assert lm_head(wrapper).weight is model.lm_head.weight


def test_fsdp2_dtensor_head_is_gathered(tmp_path):
    """A DTensor LM head (FSDP2 / tensor parallel) comes back whole and differentiable (one gloo process)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = MODELS["qwen2"]()
        mesh = init_device_mesh("cpu", (1,))
        full = model.lm_head.weight.detach().clone()
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        head = lm_head(model)
        assert type(head.weight) is torch.Tensor and torch.equal(head.weight, full)
        head.weight.sum().backward()
        assert model.lm_head.weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_gathered_lm_head_is_a_no_op_without_zero3():
    from grpo_fast.models import gathered_lm_head

    with gathered_lm_head(MODELS["llama"]()):
        pass
