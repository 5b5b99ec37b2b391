"""FastGRPOTrainer against TRL 1.16's GRPOTrainer: same seed, same tiny model, a few optimizer steps.

Tolerances: logged losses, grad norms and entropies within 1e-4 relative (1e-7 absolute); updated weights within
1e-4 absolute. Both heads' gradients agree with the float64 reference to ~1e-6, but AdamW divides each gradient by
its running magnitude, so elements whose gradient is near zero amplify those differences: 1e-4 is 0.5% of the
largest possible update (2 steps at lr 1e-2).
"""

import functools

import pytest
import torch

trl = pytest.importorskip("trl")

from grpo_fast import packed_attention as attention  # noqa: E402
from grpo_fast.integrations import trl as dropin  # noqa: E402
from tests.helpers import (  # noqa: E402
    ROOT,
    build_grpo,
    float64_norms,
    run_grpo,
    tiny_model,
    tiny_moe_model,
    tiny_vlm,
)

CONFIGS = {
    "dapo": dict(),
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    # the second iteration reuses the rollout, so the old log-probs differ and the weights are not all 1
    "vespo": dict(loss_type="vespo", num_iterations=2, beta=0.04, vespo_k_neg=2.5, vespo_lambda_pos=2.5),
    # the level reaches only the KL's bias correction: vespo's weight sums the token log-ratios either way
    "vespo_sequence": dict(loss_type="vespo", importance_sampling_level="sequence", num_iterations=2, beta=0.04,
                           use_bias_correction_kl=True),
    "gspo_sequence": dict(importance_sampling_level="sequence", loss_type="grpo"),
    # GSPO's small clip range on a reused rollout: sequences clip, and the KL's correction is the sequence ratio
    "gspo_clipped_kl": dict(importance_sampling_level="sequence", loss_type="grpo", num_iterations=2,
                            epsilon=3e-4, epsilon_high=4e-4, beta=0.04, use_bias_correction_kl=True),
    "luspo": dict(importance_sampling_level="sequence", loss_type="luspo"),
    "luspo_token": dict(loss_type="luspo", beta=0.04),      # TRL's default level: one ratio per token, fused
    "beta_kl": dict(beta=0.1),
    "grad_accumulation": dict(gradient_accumulation_steps=2, per_device_train_batch_size=2),
    "num_iterations": dict(num_iterations=2, epsilon_high=0.28),
    "entropy_bonus_temperature": dict(entropy_coef=0.01, temperature=0.7),
    # a first pass without gradients finds the masks, then the fused pass (4 GEMM passes)
    "entropy_filter_kl": dict(top_entropy_quantile=0.5, beta=0.04),
    # the bonus averages over the high-entropy tokens only; adaptive: the controller measures them too
    "entropy_filter_bonus": dict(top_entropy_quantile=0.5, entropy_coef=0.05),
    "entropy_filter_adaptive": dict(top_entropy_quantile=0.3, use_adaptive_entropy=True, entropy_coef=0.05,
                                    entropy_target=6.0, loss_type="grpo"),
    "off_policy_mask": dict(off_policy_mask_threshold=0.0, num_iterations=2),
    # the masks multiply vespo's term after its sequence weight, which they do not enter
    "vespo_masks": dict(loss_type="vespo", num_iterations=2, off_policy_mask_threshold=0.0, top_entropy_quantile=0.5,
                        beta=0.04),
    # the controller raises the coefficient after the first window (entropy ~5.5 <= target), which then applies
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.05, entropy_target=6.0,
                             gradient_accumulation_steps=2, per_device_train_batch_size=2),
    # above the target: the coefficient falls and the bonus does not apply
    "adaptive_entropy_above_target": dict(use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=5.0),
}


FUSED = set(CONFIGS)


@pytest.fixture
def calls(monkeypatch):
    """Counts grpo_fast's log-prob and fused-loss calls, so a silent fallback to TRL would fail the tests."""
    count = {"logprobs": 0, "fused_loss": 0}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            count[name] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(dropin, "token_logprobs", counting("logprobs", dropin.token_logprobs))
    monkeypatch.setattr(dropin, "checked_policy_loss", counting("fused_loss", dropin.checked_policy_loss))
    return count


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_grpo_trainer(name, tmp_path, calls):
    config = CONFIGS[name]
    steps = 3 if name in ("num_iterations", "grad_accumulation", "vespo", "vespo_sequence", "gspo_clipped_kl",
                          "off_policy_mask", "vespo_masks",
                          "adaptive_entropy", "entropy_filter_adaptive") else 2
    expected = run_grpo(trl.GRPOTrainer, tmp_path / "trl", steps=steps, **config)
    assert calls == {"logprobs": 0, "fused_loss": 0}
    actual = run_grpo(dropin.FastGRPOTrainer, tmp_path / "fast", steps=steps, **config)
    if name in FUSED:
        assert calls["fused_loss"] > 0, "the fused loss was not used"
    else:
        assert calls["fused_loss"] == 0 and calls["logprobs"] > 0, "TRL's loss on grpo_fast log-probs expected"
    assert_trains_like(actual, expected)


def assert_trains_like(actual, expected):
    """actual's logged losses, grad norms, entropies and TRL's loss metrics equal expected's to the module's
    tolerances, and so do its updated weights, which training moved (else the comparison would show nothing)."""
    logged_by_trl = ("clip_ratio", "cispo", "vespo", "policy_loss", "kl", "entropy_coef")
    keys = ["loss", "grad_norm", "entropy"] + [k for k in expected.state.log_history[0] if k.startswith(logged_by_trl)]
    for key in keys:
        torch.testing.assert_close(torch.tensor(logged(actual, key)), torch.tensor(logged(expected, key)),
                                   rtol=1e-4, atol=1e-7, msg=key)
    for (param_name, ours), theirs in zip(actual.model.named_parameters(), expected.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4, msg=param_name)
    initial = tiny_model(len(actual.processing_class)).state_dict()
    moved = max((p - initial[n]).abs().max().item() for n, p in actual.model.named_parameters())
    assert moved > 1e-4, "training did not change the weights, so the comparison shows nothing"


# (GRPOConfig options, optimizer steps). steps_per_generation cuts each generation batch into that many optimizer
# steps (num_iterations > 1 then replays the buffered batch), so every step after a rollout's first trains on
# completions of a policy that has since moved: TRL scores the batch's old log-probs at the rollout, and dapo's
# normalizer is the generation batch's token count brought to one accumulation window.
STEPS_PER_GENERATION = {
    # a clip range small enough that the second step's ratios, against the first step's policy, clip
    "two_steps": (dict(steps_per_generation=2, epsilon=1e-3), 2),
    # TRL's default clip range: the replayed slices (steps 3 and 4) clip
    "num_iterations": (dict(steps_per_generation=2, num_iterations=2), 4),
    # more steps per generation than accumulation steps: the second optimizer step's micro-batches are off-policy
    "grad_accumulation": (dict(steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=2,
                               epsilon=1e-3), 2),
}


@pytest.mark.parametrize("name", sorted(STEPS_PER_GENERATION))
def test_steps_per_generation_matches_grpo_trainer(name, tmp_path, monkeypatch):
    """TRL's steps_per_generation: the fused loss takes the old log-probs TRL hands each micro-batch and the
    generation batch's token count, and trains to GRPOTrainer's weights. Every fused call gets old log-probs;
    the first optimizer step is on-policy (nothing clips), a later one is not (some tokens clip), so the ratio
    reached the loss."""
    config, steps = STEPS_PER_GENERATION[name]
    expected = run_grpo(trl.GRPOTrainer, tmp_path / "trl", steps=steps, **config)
    old_logps, fused_loss = [], dropin.checked_policy_loss
    monkeypatch.setattr(dropin, "checked_policy_loss",
                        lambda *args, **kwargs: old_logps.append(kwargs["old_logps"]) or fused_loss(*args, **kwargs))
    actual = run_grpo(dropin.FastGRPOTrainer, tmp_path / "fast", steps=steps, **config)
    assert len(old_logps) == steps * config.get("gradient_accumulation_steps", 1), "the fused loss was not used"
    assert all(old is not None for old in old_logps), "a micro-batch reached the loss without old log-probs"
    assert_trains_like(actual, expected)
    clipped = logged(actual, "clip_ratio/region_mean")
    assert clipped[0] == 0 and max(clipped[1:]) > 0, clipped


@pytest.mark.parametrize("name", ["dapo", "grpo_kl_grad_accumulation", "dapo_router_logits_off_in_config"])
def test_moe_matches_grpo_trainer(name, tmp_path, calls):
    """A Qwen3-MoE-style model: the policy loss fused from the backbone's final hidden states, the router's
    load-balancing loss as the model computes it, added as TRL adds it (divided by the accumulation steps).
    "router_logits_off_in_config": output_router_logits=False with a nonzero router_aux_loss_coef, as released
    Qwen3-MoE checkpoints ship; TRL still adds the aux loss, asking the model for router logits on each call."""
    config = {"dapo": {}, "grpo_kl_grad_accumulation": dict(loss_type="grpo", beta=0.04, gradient_accumulation_steps=2,
                                                            per_device_train_batch_size=2),
              "dapo_router_logits_off_in_config": {}}[name]
    make_model = functools.partial(tiny_moe_model, output_router_logits="router_logits_off" not in name)
    expected = run_grpo(trl.GRPOTrainer, tmp_path / "trl", steps=3, make_model=make_model, **config)
    assert expected.aux_loss_enabled and logged(expected, "aux_loss")
    assert expected.model.config.output_router_logits == ("router_logits_off" not in name)
    actual = run_grpo(dropin.FastGRPOTrainer, tmp_path / "fast", steps=3, make_model=make_model, **config)
    assert calls["fused_loss"] > 0 and actual.fused_loss_unsupported({}) is None
    assert (calls["logprobs"] > 0) == ("kl" in name)       # the reference's log-probs through grpo_fast's head
    for key in ("loss", "grad_norm", "entropy", "aux_loss", "clip_ratio/region_mean") + (("kl",) if "kl" in name
                                                                                         else ()):
        torch.testing.assert_close(torch.tensor(logged(actual, key)), torch.tensor(logged(expected, key)),
                                   rtol=1e-4, atol=1e-7, msg=key)
    for (param_name, ours), theirs in zip(actual.model.named_parameters(), expected.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4, msg=param_name)
    initial = tiny_moe_model(len(actual.processing_class)).state_dict()
    router = [n for n in initial if n.endswith("mlp.gate.weight")]
    assert router and max((actual.model.state_dict()[n] - initial[n]).abs().max().item() for n in router) > 1e-5, \
        "the router did not move: the aux loss's gradient is not tested"


def test_lora_matches_grpo_trainer(tmp_path, calls):
    """A LoRA run: the LM head is frozen, so the fused loss skips its weight GEMM; adapters train alike."""
    peft = pytest.importorskip("peft")
    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    expected = run_grpo(trl.GRPOTrainer, tmp_path / "trl", peft_config=lora(), beta=0.1)
    actual = run_grpo(dropin.FastGRPOTrainer, tmp_path / "fast", peft_config=lora(), beta=0.1)
    assert calls["fused_loss"] > 0
    for key in ("loss", "grad_norm", "kl"):
        torch.testing.assert_close(torch.tensor(logged(actual, key)), torch.tensor(logged(expected, key)),
                                   rtol=1e-4, atol=1e-7, msg=key)
    trained = [(n, p) for n, p in actual.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    reference = dict(expected.model.named_parameters())
    for name, param in trained:
        torch.testing.assert_close(param, reference[name], rtol=0, atol=1e-4, msg=name)


def test_patch_existing_trainer_is_idempotent(tmp_path, calls):
    trainer = run_grpo(trl.GRPOTrainer, tmp_path, steps=1)
    forward = trainer.model.forward
    dropin.patch_grpo_trainer(trainer)
    assert trainer.model.forward is not forward
    patched = trainer.model.forward
    dropin.patch_grpo_trainer(trainer)
    assert trainer.model.forward is patched
    trainer.args.max_steps = 2
    trainer.train()
    assert calls["logprobs"] > 0


def test_example_learns(tmp_path):
    """examples/trl_grpo.py runs on CPU and its reward rises (the drop-in trains, not only runs)."""
    import os
    import re
    import subprocess
    import sys

    script = os.path.join(ROOT, "examples", "trl_grpo.py")
    done = subprocess.run([sys.executable, script, "--steps", "100"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = map(float, re.search(r"reward ([\d.]+) -> ([\d.]+)", done.stdout).groups())
    assert last > first + 0.5, done.stdout


def test_vespo_outside_grpo_fast_range_runs_trls_loss(tmp_path):
    """vespo options LossConfig refuses (TRL floors lambda at 1e-4 instead), and a rollout correction that is not
    1 on padding (TRL's weights sum over padding too), leave the loss to TRL."""
    trainer = run_grpo(dropin.FastGRPOTrainer, tmp_path, steps=1, loss_type="vespo")
    assert trainer.fused_loss_unsupported({}) is None
    trainer.args.vespo_lambda_neg = 0.0
    assert trainer.fused_loss_unsupported({}) == "vespo_k_* < 0 or vespo_lambda_* <= 0"
    trainer.args.vespo_lambda_neg = 2.0
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = 0.5, 3.0
    assert trainer.fused_loss_unsupported({}) is None
    trainer.vllm_importance_sampling_clip_min = 1.5
    assert "vllm_importance_sampling_clip_min > 1" in trainer.fused_loss_unsupported({})


def test_one_warning_at_construction_lists_the_fallbacks(tmp_path):
    """A configuration the fused loss does not reproduce is named once, with every reason, when the trainer is
    built; one it reproduces builds without a word."""
    import warnings

    with pytest.warns(UserWarning, match=r"TRL's own loss code runs on grpo_fast's log-probs .* for: "
                                         r"vespo_k_\* < 0 or vespo_lambda_\* <= 0$") as record:
        trainer = run_grpo(dropin.FastGRPOTrainer, tmp_path / "a", steps=1, loss_type="vespo", vespo_lambda_neg=0.0)
    assert sum("TRL's own loss code" in str(w.message) for w in record) == 1
    # every reason is listed (vLLM itself is not started here: the attributes are what the check reads)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_clip_min = 1.5
    assert len(trainer.fallback_reasons({})) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="(?!grpo_fast)")          # other libraries' notices
        run_grpo(dropin.FastGRPOTrainer, tmp_path / "b", steps=1, top_entropy_quantile=0.5)


def test_truncated_sampling_with_the_vllm_correction_names_the_bias():
    """TRL 1.16 hands over no kept sets: with vLLM's correction under top_p / top_k / min_p the warning names the
    bias and the fix; without the correction, or without truncation, there is nothing to say."""
    from trl import GRPOConfig

    def config(**fields):
        return GRPOConfig(output_dir="unused", report_to=[], bf16=False, use_cpu=True, **fields)

    message = dropin.truncated_sampling_bias(config(use_vllm=True, top_p=0.9, top_k=20))
    assert message.startswith("grpo_fast: vLLM samples with top_p=0.9, top_k=20, so its log-probs are over each "
                              "token's kept set") and "biased low by each token's kept mass" in message
    assert "min_p=0.05" in dropin.truncated_sampling_bias(config(use_vllm=True, min_p=0.05))
    assert dropin.truncated_sampling_bias(config(use_vllm=True)) is None
    assert dropin.truncated_sampling_bias(config(use_vllm=True, top_p=0.9,
                                                 vllm_importance_sampling_correction=False)) is None
    assert dropin.truncated_sampling_bias(config(top_p=0.9)) is None              # no vLLM: TRL's own sampling


@pytest.mark.parametrize("name", ["dapo", "grpo_kl_num_iterations"])
def test_vision_language_matches_grpo_trainer(name, tmp_path, calls):
    """A Qwen2-VL model through TRL's VLM path: pixel values and image grids go through the model's own multimodal
    forward to the final hidden states, and the loss is fused from them (the reference's and old log-probs through
    grpo_fast's head too, with the images)."""
    config = {"dapo": {}, "grpo_kl_num_iterations": dict(loss_type="grpo", beta=0.04, num_iterations=2)}[name]
    expected = run_grpo(trl.GRPOTrainer, tmp_path / "trl", steps=3, vision=True, **config)
    actual = run_grpo(dropin.FastGRPOTrainer, tmp_path / "fast", steps=3, vision=True, **config)
    assert calls["fused_loss"] > 0 and actual.fused_loss_unsupported({"pixel_values": torch.zeros(1)}) is None
    assert (calls["logprobs"] > 0) == ("kl" in name)
    for key in ("loss", "grad_norm", "entropy", "clip_ratio/region_mean") + (("kl",) if "kl" in name else ()):
        torch.testing.assert_close(torch.tensor(logged(actual, key)), torch.tensor(logged(expected, key)),
                                   rtol=1e-4, atol=1e-7, msg=key)
    for (param_name, ours), theirs in zip(actual.model.named_parameters(), expected.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4, msg=param_name)
    initial = tiny_vlm()[0].state_dict()
    vision = [n for n in initial if ".visual." in n and n.endswith("weight")]
    assert vision and min((actual.model.state_dict()[n] - initial[n]).abs().max().item() for n in vision) > 1e-4, \
        "the vision tower did not train: the images did not reach the loss"


def shared_prompt_batch(vocab: int, prompt_lengths: tuple, seed: int = 0) -> dict:
    """TRL's training inputs for two prompts of prompt_lengths tokens (left-padded to the longer) with three
    completions each, of 6, 3, 0 and 6, 4, 1 tokens (right-padded; the empty one as TRL masks a truncated one)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_length, completion_length, lengths = max(prompt_lengths), 6, torch.tensor([6, 3, 0, 6, 4, 1])
    prompt_ids = torch.zeros(6, prompt_length, dtype=torch.long)
    prompt_mask = torch.zeros(6, prompt_length, dtype=torch.long)
    for group, length in enumerate(prompt_lengths):
        prompt = torch.randint(3, vocab, (length,), generator=generator)
        prompt_ids[3 * group:3 * group + 3, prompt_length - length:] = prompt
        prompt_mask[3 * group:3 * group + 3, prompt_length - length:] = 1
    completion_mask = (torch.arange(completion_length)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, vocab, (6, completion_length), generator=generator) * completion_mask
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "num_items_in_batch": completion_mask.sum().double(),
            "advantages": torch.randn(6, generator=generator, dtype=torch.float64),
            "old_per_token_logps": None, "ref_per_token_logps": None}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("prompt_lengths", [(7, 7), (5, 7)])
def test_shared_prompts_equal_the_padded_forward_in_float64(loss_type, prompt_lengths, tmp_path, monkeypatch):
    """The loss's forward with each prompt once in a packed row against TRL's padded batch: the loss and every
    gradient equal in float64 (groups of 3, a completion of 0 tokens). A left-padded prompt sits at other absolute
    positions in TRL's batch (its positions count the padding), which RoPE's relative rotation does not see but
    transformers computes in float32: those rows agree to float32's rounding. On transformers 5.25 equal-length
    prompts agree to float32's rounding as well (1.1e-7 relative in the norms' gradients, measured; not traced),
    where 5.19-5.24 give float64's."""
    import transformers
    from packaging.version import Version

    exact = len(set(prompt_lengths)) == 1 and Version(transformers.__version__) < Version("5.25")
    rtol = 1e-10 if exact else 1e-6
    trainer = build_grpo(dropin.FastGRPOTrainer, tmp_path, loss_type=loss_type,
                         trainer_kwargs={"share_prompts": True})
    assert trainer.share_prompts and attention.attention_name(trainer.model) == attention.NAME
    packed_rows = []
    shared_prompt_row = attention.shared_prompt_row
    monkeypatch.setattr(attention, "shared_prompt_row", lambda *a: packed_rows.append(a) or shared_prompt_row(*a))
    model = float64_norms(trainer.model).train()
    trainer.current_gradient_accumulation_steps = 1          # as the training loop sets it
    inputs = shared_prompt_batch(len(trainer.processing_class), prompt_lengths)
    results = {}
    for share in (True, False):
        trainer.share_prompts = share
        model.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        results[share] = loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}
    assert len(packed_rows) == 1, "the shared-prompt row was not built"
    (shared_loss, shared_grads), (padded_loss, padded_grads) = results[True], results[False]
    torch.testing.assert_close(shared_loss, padded_loss, rtol=rtol, atol=1e-14)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=rtol, atol=rtol * grad.abs().max().item(), msg=name)
    assert max(grad.abs().max().item() for grad in padded_grads.values()) > 1e-4


def test_shared_prompts_stay_off_by_default_and_where_they_are_not_exact(tmp_path):
    """Off by default, and for a model that adds a router aux loss (it counts tokens by the attention mask) even
    when asked: the model keeps transformers' sdpa. Asked for on a decoder of SHARED_PROMPT_MODELS: on."""
    on = build_grpo(dropin.FastGRPOTrainer, tmp_path / "on", trainer_kwargs={"share_prompts": True})
    assert on.share_prompts and attention.attention_name(on.model) == attention.NAME
    off = build_grpo(dropin.FastGRPOTrainer, tmp_path / "off")
    moe = build_grpo(dropin.FastGRPOTrainer, tmp_path / "moe", make_model=tiny_moe_model,
                     trainer_kwargs={"share_prompts": True})
    for trainer in (off, moe):
        assert not trainer.share_prompts and attention.attention_name(trainer.model) == "sdpa"


def test_generation_runs_sdpa_and_the_loss_the_variable_length_attention(tmp_path, monkeypatch):
    """With shared prompts, TRL's generation and scoring run transformers' own sdpa (padded and cached calls), and
    the loss's forward and backward (gradient checkpointing recomputes with the attention of the moment) the
    variable-length attention that the packed row needs."""
    trainer = build_grpo(dropin.FastGRPOTrainer, tmp_path, steps=1, gradient_checkpointing=True,
                         trainer_kwargs={"share_prompts": True})
    seen = {"generate": set(), "loss": set()}
    generate = trainer.model.generate
    monkeypatch.setattr(trainer.model, "generate", lambda *a, **k: seen["generate"].add(
        attention.attention_name(trainer.model)) or generate(*a, **k))
    from transformers import AttentionInterface

    calls = []
    monkeypatch.setitem(AttentionInterface._global_mapping, attention.NAME, lambda *a, **k: calls.append(
        k.get("shared_prompts") is not None) or attention.varlen_attention_forward(*a, **k))
    compute_loss = trainer._compute_loss
    monkeypatch.setattr(trainer, "_compute_loss", lambda *a: seen["loss"].add(
        attention.attention_name(trainer.model)) or compute_loss(*a))
    trainer.train()
    assert seen == {"generate": {"sdpa"}, "loss": {attention.NAME}}
    assert attention.attention_name(trainer.model) == attention.NAME
    layers = trainer.model.config.num_hidden_layers
    assert calls.count(True) == 2 * layers, calls   # the packed row's forward and its recomputation, every layer


def test_options_the_loss_never_reads_are_ignored_as_trl_ignores_them(tmp_path, calls):
    """dapo reads no vespo_* nor sapo_* option: values grpo_fast would refuse there (lambda 0, a gate temperature
    of 0) are ignored, as GRPOTrainer ignores them, and the fused loss trains to GRPOTrainer's weights."""
    config = dict(loss_type="dapo", vespo_lambda_pos=0.0, sapo_temperature_neg=0.0)
    expected = run_grpo(trl.GRPOTrainer, tmp_path / "trl", steps=2, **config)
    actual = run_grpo(dropin.FastGRPOTrainer, tmp_path / "fast", steps=2, **config)
    assert calls["fused_loss"] > 0, "the fused loss was not used"
    for (param_name, ours), theirs in zip(actual.model.named_parameters(), expected.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4, msg=param_name)
    initial = tiny_model(len(actual.processing_class)).state_dict()
    assert max((p - initial[n]).abs().max().item() for n, p in actual.model.named_parameters()) > 1e-4


@pytest.mark.parametrize("config,message", [
    (dict(loss_type="sapo", sapo_temperature_neg=0.0),
     "sapo_temperature_neg must be a finite number > 0 (GRPOConfig.sapo_temperature_neg), got 0.0"),
    (dict(epsilon=1e39),
     "epsilon must be a finite number in [0, 3.4028234663852886e+38] (GRPOConfig.epsilon), got 1e+39"),
    (dict(loss_type="cispo", epsilon_high=-1.0),
     "epsilon_high must be a finite number >= 0 (GRPOConfig.epsilon_high), got -1.0"),
    (dict(beta=1e38), "beta must be a finite number in [0, 1e+18] (GRPOConfig.beta), got 1e+38"),
    (dict(entropy_coef=1e19),
     "entropy_coef must be a finite number in [-1e+18, 1e+18] (GRPOConfig.entropy_coef), got 1e+19"),
    (dict(temperature=1e-12), "temperature must be in [1e-09, 1e+09] (LogitTransform.temperature), got 1e-12"),
], ids=["sapo_temperature", "epsilon", "cispo_cap", "beta", "entropy_coef", "temperature"])
def test_what_grpo_fast_refuses_is_refused_at_construction(config, message, tmp_path, monkeypatch):
    """An option the loss reads, out of grpo_fast's range: one line naming the GRPOConfig field, raised by the
    constructor, before any rollout (GRPOTrainer itself builds with it)."""
    import re

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions",
                        lambda *a, **k: pytest.fail("a rollout ran before the refusal"))
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        build_grpo(dropin.FastGRPOTrainer, tmp_path, **config)
