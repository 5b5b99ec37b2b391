"""What the plan counts around the update: a rollout process (max_staleness >= 1), the HF engine's generation
peak, and the fp32 gradient sum of bf16 weights over several micro-batches."""

import dataclasses
import json

from grpo_fast.cli import main
from grpo_fast.train.plan import fit
from grpo_fast.train.plan import memory as P
from tests.helpers import flat_config

SMALL = P.ModelShape(hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                     vocab_size=1000, tie_word_embeddings=True)


def test_a_rollout_process_adds_at_least_its_weights():
    shape = P.PRESETS["qwen2.5-1.5b"]
    for dtype, weight_bytes in (("bf16-autocast", 4), ("bf16", 2), ("fp32", 4)):
        job = P.Job(completion_length=2048, engine="hf", dtype=dtype)
        alone, stale = P.plan(shape, job), P.plan(shape, dataclasses.replace(job, max_staleness=1))
        engine_weights = shape.num_parameters() * weight_bytes
        assert stale["rollout_weights"] == engine_weights, dtype
        assert stale["total"] - alone["total"] >= engine_weights, dtype
        assert stale["rollout_kv_cache"] == P.hf_kv_cache(shape, job)
        # the rollout process's sampling log-probs: one decode step's logits and work for the step's rows, and an
        # fp32 value a sampled token in a buffer that doubles (its sampler takes them as it draws, no step's logits
        # are kept)
        rows = job.prompts_per_step * job.group_size
        assert stale["rollout_logits"] == (rows * shape.vocab_size * (weight_bytes + P.GENERATE_LOGIT_BYTES)
                                           + rows * job.completion_length * 8)
        longer = P.plan(shape, dataclasses.replace(job, max_staleness=1, completion_length=4096))
        assert longer["rollout_logits"] - stale["rollout_logits"] == rows * 2048 * 8
        assert stale["total"] == sum(v for k, v in stale.items() if k != "total")
        assert stale["kv_cache"] == 0            # the trainer itself no longer generates
        for card, capacity in P.CARDS.items():
            assert P.fits_in(shape, dataclasses.replace(job, max_staleness=1), P.plan(
                shape, dataclasses.replace(job, max_staleness=1), capacity), capacity)[1] > P.fits_in(
                    shape, job, P.plan(shape, job, capacity), capacity)[1] + engine_weights - 1, card
    # vLLM in its own process: its weights and KV cache stay in its pool, which fits_in adds either way
    vllm = P.Job(completion_length=2048, engine="vllm")
    stale = P.plan(shape, dataclasses.replace(vllm, max_staleness=2))
    assert "rollout_weights" not in stale and stale["total"] == P.plan(shape, vllm)["total"]


def test_hf_kv_cache_holds_every_prompt_of_the_step_at_full_length():
    # one model.generate call for all of the step's prompts (HFEngine batches them): prompts_per_step x group_size
    # sequences, keys and values of every layer in fp32 weights, and one decode step's logits of those rows
    job = P.Job(prompt_length=10, completion_length=2000, group_size=64, prompts_per_step=4, dtype="fp32",
                engine="hf", device="cpu")
    kv_dim = 2 * (64 // 4)
    expected = 2 * 3 * kv_dim * 4 * 64 * (10 + 2000) * 4
    assert P.hf_kv_cache(SMALL, job) == expected
    assert P.hf_kv_cache(SMALL, dataclasses.replace(job, prompts_per_step=1)) == expected // 4
    estimate = P.plan(SMALL, job)
    assert estimate["kv_cache"] == expected                        # it is the peak here, before the update
    assert estimate.generation_peak == estimate["total"] > estimate.training_peak
    assert estimate["generation_logits"] == 4 * 64 * 1000 * (4 + P.GENERATE_LOGIT_BYTES)
    assert estimate["gradients"] == estimate["activations"] == estimate["loss_buffers"] == 0     # freed / not yet
    assert estimate["total"] == sum(estimate[k] for k in ("weights", "optimizer", "reference_model", "runtime",
                                                          "kv_cache", "generation_logits"))
    # bf16 weights: a bf16 cache; vLLM's cache is its pool's, not counted here
    assert P.hf_kv_cache(SMALL, dataclasses.replace(job, dtype="bf16")) == expected // 2
    assert P.plan(SMALL, dataclasses.replace(job, engine="vllm"))["kv_cache"] == 0
    # a short generation: the training peak stays the peak, its components as before
    short = P.plan(SMALL, dataclasses.replace(job, group_size=2, completion_length=200))
    assert short["kv_cache"] == 0 and short["total"] == short.training_peak >= short.generation_peak > 0


def test_bf16_weights_sum_gradients_in_fp32_over_several_micro_batches():
    shape = P.PRESETS["qwen2.5-0.5b"]
    two = P.Job(dtype="bf16", group_size=2, prompts_per_step=1, micro_batch_size=1)
    one = dataclasses.replace(two, micro_batch_size=2)
    assert two.micro_batches_per_step == 2 and one.micro_batches_per_step == 1
    assert P.plan(shape, two)["fp32_gradient_sum"] == 4 * shape.num_parameters()
    assert P.plan(shape, one)["fp32_gradient_sum"] == 0
    # micro_batch_tokens cutting the same two sequences apart counts it too
    by_tokens = dataclasses.replace(one, micro_batch_tokens=two.prompt_length + two.completion_length)
    assert P.plan(shape, by_tokens)["fp32_gradient_sum"] == 4 * shape.num_parameters()
    # fp32 weights (bf16-autocast, fp32) and fp32 LoRA adapters accumulate in fp32 .grad already
    for fields in ({"dtype": "bf16-autocast"}, {"dtype": "fp32"}, {"lora_rank": 16}):
        assert P.plan(shape, dataclasses.replace(two, **fields))["fp32_gradient_sum"] == 0, fields
    # grad_accum_dtype bf16 sums them in bf16, without the copy; the trainer's key reaches the plan
    assert P.plan(shape, dataclasses.replace(two, grad_accum_dtype="bf16"))["fp32_gradient_sum"] == 0
    job = fit.training_job(flat_config(dtype="bf16", grad_accum_dtype="bf16"), 64, "cuda")
    assert job.grad_accum_dtype == "bf16"


def test_training_job_carries_max_staleness():
    config = flat_config(max_staleness=1, engine="hf")
    job = fit.training_job(config, 64, "cuda")
    assert job.max_staleness == 1
    assert fit.training_job(flat_config(), 64, "cuda").max_staleness == 0
    assert "rollout_weights" in P.plan(fit.training_shape(config.policy), job)


def test_cli_max_staleness(capsys):
    assert main(["plan", "qwen2.5-0.5b", "--engine", "hf", "--max-staleness", "1", "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)
    assert reported["job"]["max_staleness"] == 1
    assert reported["components"]["rollout_weights"] == P.PRESETS["qwen2.5-0.5b"].num_parameters() * 4
    assert main(["plan", "qwen2.5-0.5b", "--engine", "hf", "--max-staleness", "1"]) == 0
    table = capsys.readouterr().out
    assert "rollout_weights" in table and "rollout_kv_cache" in table and "max_staleness=1" in table
    assert main(["plan", "qwen2.5-0.5b", "--engine", "hf"]) == 0
    assert "HF generation peak" in capsys.readouterr().out
    assert main(["plan", "qwen2.5-0.5b", "--max-staleness", "-1"]) == 2
    assert capsys.readouterr().err.strip() == ("grpo-fast plan: --max-staleness must be >= 0 (0: generate, then "
                                               "update; k >= 1: the engine in its own process), got -1")
