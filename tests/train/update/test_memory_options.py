"""The memory options of the trainer (grpo_fast.train.update.precision, grpo_fast.train.lora): bf16 weights with an fp32
master AdamW, torchao's 8-bit and bf16-state AdamW, LoRA through PEFT; what they compute, save and refuse."""

import copy
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train import lora
from grpo_fast.train.config import load_config  # noqa: E402
from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from grpo_fast.train.saved import checkpoint
from grpo_fast.train.update import optimizer as optim  # noqa: E402
from grpo_fast.train.update import precision  # noqa: E402
from grpo_fast.train.update.step import Policy, completion_logprobs, policy_update  # noqa: E402
from tests.helpers import flat_config, logprob_sections, update_sections  # noqa: E402
from tests.train.update.test_batching import rollout  # noqa: E402

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")


def model(seed=0, dtype=torch.float32):
    return tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=seed).to(dtype)


# ------------------------------------------------------------------------------------- AdamW with fp32 masters
def test_master_weight_adamw_is_fp32_adamw_on_bf16_weights():
    """Given the same (bf16-exact) start and gradients, the fp32 master follows torch's fp32 AdamW exactly, and
    the bf16 weight is the master rounded; fp32 parameters are stepped by AdamW itself."""
    torch.manual_seed(0)
    low = torch.nn.Linear(32, 48).to(torch.bfloat16)
    full = copy.deepcopy(low).float()
    mixed = torch.nn.Linear(32, 48)
    mixed_ref = copy.deepcopy(mixed)
    options = dict(lr=3e-3, weight_decay=0.1, betas=(0.8, 0.95))
    optimizers = [optim.MasterWeightAdamW(low.parameters(), **options),
                  torch.optim.AdamW(full.parameters(), **options),
                  optim.MasterWeightAdamW(mixed.parameters(), **options),
                  torch.optim.AdamW(mixed_ref.parameters(), **options)]
    for _ in range(5):
        for ref_param, param in zip(full.parameters(), low.parameters()):
            grad = torch.randn(param.shape).bfloat16()
            param.grad, ref_param.grad = grad, grad.float()
        for ref_param, param in zip(mixed_ref.parameters(), mixed.parameters()):
            param.grad = torch.randn(param.shape)
            ref_param.grad = param.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    for ref_param, param in zip(full.parameters(), low.parameters()):
        master = optimizers[0].state[param]["master"]
        assert master.dtype == torch.float32 and torch.equal(master, ref_param)
        assert param.dtype == torch.bfloat16 and torch.equal(param, ref_param.bfloat16())
        assert optimizers[0].state[param]["exp_avg"].dtype == torch.float32
    for ref_param, param in zip(mixed_ref.parameters(), mixed.parameters()):
        assert torch.equal(param, ref_param) and "master" not in optimizers[2].state[param]


def test_master_weight_adamw_keeps_updates_plain_bf16_adamw_loses():
    """An update under half a bf16 step: torch's AdamW on bf16 weights drops it every time, the master keeps it."""
    plain, kept = (torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16)) for _ in range(2))
    optimizers = [torch.optim.AdamW([plain], lr=1e-3, weight_decay=0.0),
                  optim.MasterWeightAdamW([kept], lr=1e-3, weight_decay=0.0)]   # bf16 step at 1.0: 2**-7
    for _ in range(20):
        for param, optimizer in zip((plain, kept), optimizers):
            param.grad = torch.ones_like(param)
            optimizer.step()
    assert torch.equal(plain, torch.ones_like(plain))                       # 20 updates of 1e-3 lost
    assert torch.allclose(optimizers[1].state[kept]["master"], torch.full((256,), 0.98), atol=1e-5)
    assert torch.equal(kept, torch.full_like(kept, 0.98))                   # rounded from the master


def test_master_weight_adamw_state_dict_keeps_fp32_masters():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(0)
    net = torch.nn.Linear(16, 16).to(torch.bfloat16)
    optimizer = optim.MasterWeightAdamW(net.parameters(), lr=1e-2)
    for _ in range(2):
        net(torch.randn(4, 16).bfloat16()).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    copy_net = copy.deepcopy(net)
    restored = optim.MasterWeightAdamW(copy_net.parameters(), lr=1e-2)
    set_optimizer_state_dict(copy_net, restored, get_optimizer_state_dict(net, optimizer))
    for param, other in zip(net.parameters(), copy_net.parameters()):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert restored.state[other][key].dtype == torch.float32, key
            assert torch.equal(restored.state[other][key], optimizer.state[param][key]), key


# ------------------------------------------------------------------------------------------- torchao's optimizers
@needs_torchao
@pytest.mark.parametrize("name", ["adamw8bit", "adamw-bf16"])
def test_low_bit_optimizers_round_bf16_weights_stochastically(name):
    """A constant update of a tenth of a bf16 step: rounded to nearest it would vanish; stochastic rounding moves
    each weight by the update on average. adamw8bit keeps 8-bit moments, adamw-bf16 bf16 ones."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    optimizer = optim.make_optimizer([param], name, lr=2**-7 / 10, weight_decay=0.0)
    for _ in range(10):
        param.grad = torch.ones_like(param)
        optimizer.step()
    moved = 1.0 - param.float().mean().item()
    assert abs(moved - 10 * 2**-7 / 10) < 0.1 * 2**-7, moved       # Adam's step is lr for a constant gradient
    moment = optimizer.state[param]["exp_avg"]
    assert ("8bit" in type(moment).__name__) == (name == "adamw8bit")
    assert name == "adamw8bit" or moment.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- the config's rules
def test_options_that_do_not_combine_name_both_keys(monkeypatch):
    with pytest.raises(ValueError, match="'adamw-bf16' keeps bf16 states .* dtype is 'fp32'; set dtype: bf16"):
        flat_config(optimizer="adamw-bf16", dtype="fp32")
    with pytest.raises(ValueError, match="optimizer 'adamw-bf16' .* lora_rank > 0 trains fp32 adapters"):
        flat_config(optimizer="adamw-bf16", dtype="bf16", lora_rank=8)
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'fp32', 'bf16-autocast', 'bf16'\), "
                                         r"got 'fp16'"):
        load_config(None, {"dtype": "fp16"})
    with pytest.raises(ValueError, match="lora_dropout must be a finite number in \\[0, 1\\), got 1.0"):
        load_config(None, {"lora_rank": "8", "lora_dropout": "1"})
    with pytest.raises(ValueError, match="lora_target_modules must name at least one linear layer"):
        load_config(None, {"lora_rank": "8", "lora_target_modules": " , "})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("torchao", "peft")
                        else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"optimizer 'adamw8bit' needs torchao, which is not installed: pip install"):
        flat_config(optimizer="adamw8bit")
    with pytest.raises(ValueError, match="lora_rank=8 needs peft, which is not installed"):
        flat_config(lora_rank=8)
    from grpo_fast.train.plan.memory import Job

    Job(optimizer="adamw8bit", lora_rank=8)              # a plan is for any machine: it needs neither library


def test_resolved_dtypes():
    assert precision.resolve("auto", "cpu") == "fp32" and precision.resolve("auto", "cpu", lora_rank=8) == "fp32"
    assert precision.resolve("auto", "cuda") == "bf16-autocast" and precision.resolve("auto", "cuda", 8) == "bf16"
    assert precision.resolve("bf16", "cpu") == "bf16"


@pytest.mark.parametrize("dtype", ["fp32", "bf16-autocast", "bf16"])
def test_policy_log_probs_in_each_dtype_are_close_to_fp64(dtype):
    net = model(dtype=precision.weights_dtype(dtype))
    batch = rollout()
    config = flat_config(dtype=dtype)
    got = completion_logprobs(Policy.of(net, dtype), batch, *logprob_sections(config))
    exact = completion_logprobs(Policy.of(copy.deepcopy(net).double(), "auto"), batch, *logprob_sections(config))
    tolerance = {"fp32": 1e-5, "bf16-autocast": 0.1, "bf16": 0.1}[dtype]        # bf16: 8 bits of mantissa
    assert (got - exact).abs().max() < tolerance
    assert dtype == "fp32" or (got - exact).abs().max() > 1e-5              # the dtype is really used


# -------------------------------------------------------------------------------------------------------- LoRA
def lora_config(**overrides):
    return flat_config(**{"lora_rank": 4, "learning_rate": 1e-2, "max_grad_norm": 1e9, **overrides})


def peft_model(config, seed=0):
    net = lora.add_adapters(model(seed), config.policy)
    with torch.no_grad():                     # PEFT starts B at 0 (a no-op adapter): make the adapters matter
        for name, param in net.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    return net


@needs_peft
def test_lora_trains_the_adapters_alone_with_the_head_frozen():
    config = lora_config()
    net = peft_model(config)
    before = {name: param.detach().clone() for name, param in net.named_parameters()}
    policy = Policy.of(net)
    optimizer = optim.make_optimizer(net.parameters(), "adamw", config.optimization.learning_rate, 0.0)
    batch = rollout()
    policy_update(policy, optimizer, batch, *update_sections(config))
    changed = {name for name, param in net.named_parameters() if not torch.equal(param, before[name])}
    assert changed and all(".lora_" in name for name in changed)
    assert changed == {name for name, param in net.named_parameters() if param.requires_grad}
    from grpo_fast.models import lm_head

    assert lm_head(net).weight.grad is None and not lm_head(net).weight.requires_grad


@needs_peft
def test_lora_reference_is_the_base_model():
    config = lora_config(beta=0.1)
    net = peft_model(config)
    base = model()                         # the same base weights, no adapters
    batch = rollout()
    reference = completion_logprobs(Policy.of(net, adapters_off=True), batch, *logprob_sections(config))
    policy = completion_logprobs(Policy.of(net), batch, *logprob_sections(config))
    assert torch.equal(reference, completion_logprobs(Policy.of(base), batch, *logprob_sections(config)))
    assert (policy - reference).abs().max() > 1e-3                         # the adapters are on otherwise


@needs_peft
def test_merged_weights_are_peft_merge_and_unload():
    config = lora_config(lora_alpha=3.0)
    net = peft_model(config)
    merged = lora.engine_weights(net)
    expected = copy.deepcopy(net).merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           model().state_dict()["model.layers.0.self_attn.q_proj.weight"])


@needs_peft
def test_lora_refuses_targets_it_cannot_adapt():
    with pytest.raises(ValueError, match=r"lora_target_modules \['wq'\] name no linear layer of the model; its "
                                         r"linear layers are \['down_proj', 'gate_proj', 'k_proj', 'lm_head'"):
        lora.add_adapters(model(), lora_config(lora_target_modules=["wq"]).policy)
    with pytest.raises(ValueError, match="lora_target_modules must not name the LM head \\('lm_head'\\)"):
        lora.add_adapters(model(), lora_config(lora_target_modules=["q_proj", "lm_head"]).policy)


@needs_peft
def test_lora_checkpoint_holds_the_adapters_and_restores_them():
    config = lora_config(sft_steps=0)
    net = peft_model(config, seed=0)
    policy = Policy.of(net)
    optimizer = optim.make_optimizer(net.parameters(), "adamw", 1e-2, 0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    policy_update(policy, optimizer, rollout(), *update_sections(config))
    state = checkpoint.training_state(policy, optimizer, scheduler, config=config)
    assert state["model"] and all(".lora_" in name for name in state["model"])
    fresh = lora.add_adapters(model(seed=0), config.policy)                 # base as loaded, adapters at init
    checkpoint.restore_model(fresh, {**state, "step": 1})
    for (name, param), (_, other) in zip(net.named_parameters(), fresh.named_parameters()):
        assert torch.equal(param, other), name
    # with a warm start the base changed: it is saved too
    assert len(checkpoint.training_state(policy, optimizer, scheduler, config=lora_config(sft_steps=5))["model"]) \
        == len(net.state_dict())
    with pytest.raises(ValueError, match="its adapters do not fit this model: missing"):
        checkpoint.restore_model(lora.add_adapters(model(), lora_config(lora_target_modules=["q_proj", "o_proj"])
                                                   .policy),
                                 {**state, "step": 1})


def test_bf16_gradients_accumulate_in_fp32_over_micro_batches(monkeypatch):
    """With bf16 weights and 8 micro-batches, the step's gradient is the fp32 sum of the 8 micro-batch gradients,
    rounded once to bf16: within one rounding (2^-8 relative) of the float64 sum, where adding them into a bf16
    .grad rounds 8 times."""
    from grpo_fast.train.rollout.generation import pack
    from grpo_fast.train.update import step as update
    from grpo_fast.train.update.step import UpdateBatch, accumulate_gradients

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (3 + row % 4,), generator=generator).tolist() for row in range(8)]
    completions = [torch.randint(1, 64, (2 + row % 5,), generator=generator).tolist() for row in range(8)]
    generation = pack(prompts, completions, [False] * 8, pad_token_id=0)
    batch = UpdateBatch(input_ids=generation.input_ids, attention_mask=generation.attention_mask,
                    prompt_length=generation.prompt_length, completion_ids=generation.completion_ids,
                    loss_mask=generation.completion_mask, advantages=torch.randn(8, generator=generator))
    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=0).to(torch.bfloat16)
    parts = []                                    # each micro-batch's own gradient, as its backward left it
    original_add = update.Fp32GradientSum.add

    def record(self):
        parts.append({p: p.grad.double() for p in self.parameters if p.grad is not None})
        original_add(self)

    monkeypatch.setattr(update.Fp32GradientSum, "add", record)
    accumulate_gradients(Policy.of(model), batch, *update_sections(flat_config(
        micro_batch_size=1, gradient_checkpointing=False, max_completion_length=8)))
    assert len(parts) == 8
    worst, errors, norms = 0.0, {"fp32": 0.0, "bf16": 0.0}, 0.0
    for param in model.parameters():
        exact = sum(part[param] for part in parts)
        in_bf16 = parts[0][param].to(torch.bfloat16)
        for part in parts[1:]:
            in_bf16 = in_bf16 + part[param].to(torch.bfloat16)    # what a bf16 .grad accumulates
        one_rounding = exact.abs().clamp(min=1e-30) * 2.0 ** -8   # bf16 keeps 8 significant bits
        worst = max(worst, float(((param.grad.double() - exact).abs() / one_rounding).max()))
        errors["fp32"] += float((param.grad.double() - exact).square().sum())
        errors["bf16"] += float((in_bf16.double() - exact).square().sum())
        norms += float(exact.square().sum())
    relative = {name: (error / norms) ** 0.5 for name, error in errors.items()}
    print(f"gradient error relative to its norm: fp32 sum {relative['fp32']:.2e}, bf16 sum {relative['bf16']:.2e}")
    assert worst <= 1.0 + 1e-3, worst                          # each weight's gradient rounded once
    assert relative["bf16"] > 1.5 * relative["fp32"], relative  # the bf16 sum is worse: the test tells them apart
    # grad_accum_dtype bf16: the sum stays in the bf16 .grad, as a bf16 .grad adds it
    parts.clear()
    model.zero_grad(set_to_none=True)
    accumulate_gradients(Policy.of(model), batch, *update_sections(flat_config(
        micro_batch_size=1, gradient_checkpointing=False, max_completion_length=8, grad_accum_dtype="bf16")))
    assert not parts and all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
