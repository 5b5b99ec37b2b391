"""policy.offload_activations in the planner: each decoder layer's saved activations on the host, as the trainer's
training forward saves them under torch.autograd.graph.save_on_cpu (counted here), one layer's back on the card,
and a host line beside the card's."""

import contextlib
import subprocess
import sys

import pytest
import torch

from grpo_fast.train.plan.memory import Job, ModelShape, offloaded_activations, plan

pytest.importorskip("transformers")


def saved_by_the_training_forward(num_layers: int, hidden: int = 128) -> tuple:
    """(bytes the trainer's offloaded training forward saves for backward, the packed row's tokens): the
    trainer's own completion_hidden with offload, save_on_cpu replaced by a hook that counts what it would move."""
    from grpo_fast.packed_attention import use_varlen_attention
    from grpo_fast.train.policy import tiny_qwen2
    from grpo_fast.train.update import step
    from grpo_fast.train.update.batching import micro_batch
    from tests.train.update.test_batching import rollout

    model = tiny_qwen2(64, hidden_size=hidden, num_layers=num_layers, num_heads=4, num_kv_heads=2, seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_varlen_attention(model, "cpu")
    batch = rollout(rows=4)
    micro = micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length, [0, 1, 2, 3], packed=True)
    packed = []

    @contextlib.contextmanager
    def counting(pin_memory=False):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            yield

    original = torch.autograd.graph.save_on_cpu
    torch.autograd.graph.save_on_cpu = counting
    try:
        step.completion_hidden(step.Policy.of(model, offload=True), micro, offload=True)
    finally:
        torch.autograd.graph.save_on_cpu = original
    return sum(packed), int(micro.model_inputs["input_ids"].shape[1])


def job_of(tokens: int, **keys) -> Job:
    """A one-sequence micro-batch of `tokens` tokens, fp32 as the measured forward."""
    return Job(prompt_length=tokens - 1, completion_length=1, group_size=2, prompts_per_step=1, micro_batch_size=1,
               dtype="fp32", engine="hf", **keys)


def test_each_layer_puts_its_input_on_the_host_as_the_trainers_forward_saves_it():
    two, tokens = saved_by_the_training_forward(2)
    four, _ = saved_by_the_training_forward(4)
    shape = ModelShape(128, 256, 4, 4, 2, 64, tie_word_embeddings=True, attention_bias=True)
    host = offloaded_activations(shape, job_of(tokens, device="cuda", offload_activations=True))
    per_layer = (four - two) // 2                                # what one more decoder layer saves
    assert per_layer * 4 == host
    # beside the layers, the forward saves the token ids, the final norm's tensors and the loss's index: a few
    # hidden-sized tensors, which the plan keeps on the card
    assert 0 < four - host <= 4 * tokens * 128 * 4


def test_the_card_keeps_one_layer_and_the_host_gets_them_all():
    shape = ModelShape(1024, 2816, 12, 16, 4, 32000)
    base = dict(prompt_length=512, completion_length=8192, micro_batch_size=1, engine="vllm", dtype="bf16")
    kept, offloaded = plan(shape, Job(**base)), plan(shape, Job(**base, offload_activations=True))
    layer = (512 + 8192) * 1024 * 2
    assert offloaded.host_activations == 12 * layer and kept.host_activations == 0
    assert kept["activations"] - offloaded["activations"] == 11 * layer
    assert kept["total"] - offloaded["total"] == 11 * layer
    no_checkpointing = plan(shape, Job(**base, gradient_checkpointing=False, offload_activations=True))
    assert no_checkpointing.host_activations > 10 * offloaded.host_activations
    on_cpu = plan(shape, Job(**{**base, "dtype": "fp32"}, device="cpu", offload_activations=True))
    assert on_cpu.host_activations == 0
    assert on_cpu["total"] == plan(shape, Job(**{**base, "dtype": "fp32"}, device="cpu"))["total"]


def test_the_command_line_and_a_config_plan_the_offload():
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.plan.fit import training_job

    config = TrainConfig.from_keys(model="tiny", offload_activations=True)
    assert training_job(config, 64, "cuda").offload_activations
    command = [sys.executable, "-m", "grpo_fast.cli", "plan", "qwen2.5-1.5b", "--completion-length", "16384",
               "--micro-batch-size", "1", "--engine", "hf", "--prompts-per-step", "1", "--group-size", "2"]
    with_offload = subprocess.run(command + ["--offload-activations"], capture_output=True, text=True, check=True)
    without = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "host (pinned) memory" in with_offload.stdout and "host (pinned)" not in without.stdout
    activations = [float(next(line.split()[1] for line in run.stdout.splitlines() if line.startswith("activations")))
                   for run in (with_offload, without)]
    assert activations[0] < activations[1]
