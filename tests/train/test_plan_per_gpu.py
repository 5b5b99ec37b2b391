"""`grpo-fast plan` per GPU: DDP's replicas and buckets, FSDP2's shards, sequence parallelism's share of a micro-batch,
each rank's share of the step's data, the trainer's refusals, and the Qwen3-8B preset."""

import dataclasses
import json
import subprocess
import sys

import pytest

from grpo_fast.train.plan.memory import CARDS, GIB, PRESETS, Job, ModelShape, check_heads, plan

H100 = CARDS["H100 80GB"]
QWEN3_8B = PRESETS["qwen3-8b"]
SHAPE = PRESETS["qwen2.5-1.5b"]         # 12 attention heads, 2 key/value heads
# the components a rank holds for the whole step, whatever the wrapper
MODEL_STATE = ("weights", "gradients", "optimizer")


def _job(**fields) -> Job:
    base = dict(completion_length=8192, prompts_per_step=16, micro_batch_size=2, engine="vllm")
    return Job(**{**base, **fields})


def test_qwen3_8b_parameter_count_is_transformers_own_and_qwens_published():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    # Qwen/Qwen3-8B's config.json, as the hub gives it
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                                      attention_bias=False, rope_theta=1000000.0)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    counted = sum(p.numel() for p in model.parameters())
    assert QWEN3_8B.num_parameters() == counted
    norms = sum(p.numel() for name, p in model.named_parameters() if "q_norm" in name or "k_norm" in name)
    assert norms == 36 * 2 * 128 and dataclasses.replace(QWEN3_8B, qk_norm=False).num_parameters() == counted - norms
    # Qwen's model card: 8.2B parameters, 6.95B without the embeddings (input and output)
    assert round(counted / 1e9, 1) == 8.2
    assert round((counted - 2 * 151936 * 4096) / 1e9, 2) == 6.95
    # a config.json of model_type qwen3 counts its query / key norms too
    assert config.model_type == "qwen3"


def test_a_qwen3_config_json_gives_the_preset(tmp_path):
    transformers = pytest.importorskip("transformers")
    from grpo_fast.train.plan.memory import load_shape

    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False)
    config.save_pretrained(tmp_path)
    shape = load_shape(str(tmp_path))
    assert shape.num_parameters() == QWEN3_8B.num_parameters() and shape.qk_norm
    assert shape.max_position_embeddings == 40960 and not shape.attention_bias


@pytest.mark.parametrize("gpus", [2, 8])
@pytest.mark.parametrize("lora_rank", [0, 16])
def test_fsdp2_shards_the_model_state_exactly_over_all_ranks(gpus, lora_rank):
    dtype = "bf16" if lora_rank else "bf16-autocast"
    one = plan(QWEN3_8B, _job(lora_rank=lora_rank, dtype=dtype), H100)
    sharded = plan(QWEN3_8B, _job(lora_rank=lora_rank, dtype=dtype, gpus=gpus, distributed="fsdp2"), H100)
    for name in MODEL_STATE:
        assert sharded[name] == one[name] // gpus, name
    # not sharded: the full gradient FSDP2 keeps between micro-batches with the reduction off (2 micro-batches of
    # 2 x 8 sequences here), the gathered root and layers, and autocast's copies of the gathered weights
    per_rank_sequences = 16 // gpus * 8
    assert (sharded["fsdp2_unsharded_gradients"] == one["gradients"]) == (per_rank_sequences > 2)
    param_bytes = 4 if dtype == "bf16-autocast" else 2
    root = QWEN3_8B.num_parameters() - 36 * QWEN3_8B.layer_parameters()
    assert root == 2 * 151936 * 4096 + 4096                       # embeddings, LM head, final norm
    adapters = 16 * sum(a + b for a, b in QWEN3_8B.linear_shapes())
    layer_gradients = adapters * 4 if lora_rank else QWEN3_8B.layer_parameters() * param_bytes
    assert sharded["fsdp2_gathered"] == (root + 2 * QWEN3_8B.layer_parameters()) * param_bytes + 2 * layer_gradients
    assert sharded["autocast_weight_copies"] == one["autocast_weight_copies"]
    assert "ddp_gradient_buckets" not in sharded and one.keys() <= sharded.keys()


def test_fsdp2_keeps_no_unsharded_gradient_with_one_micro_batch_an_optimizer_step():
    job = _job(gpus=8, distributed="fsdp2", prompts_per_step=8, group_size=2, micro_batch_size=2)
    assert job.micro_batches_per_step == 1 and plan(QWEN3_8B, job, H100)["fsdp2_unsharded_gradients"] == 0
    # two mini-batches of one group each: still one micro-batch an optimizer step
    halves = dataclasses.replace(job, prompts_per_step=16, steps_per_generation=2)
    assert halves.micro_batches_per_step == 1 and plan(QWEN3_8B, halves, H100)["fsdp2_unsharded_gradients"] == 0


def test_ddp_keeps_full_replicas_and_a_second_copy_of_the_gradients_in_its_buckets():
    one = plan(QWEN3_8B, _job(dtype="bf16", optimizer="adamw8bit"), H100)
    ddp = plan(QWEN3_8B, _job(dtype="bf16", optimizer="adamw8bit", gpus=8), H100)
    for name in MODEL_STATE:
        assert ddp[name] == one[name], name
    # gradient_as_bucket_view=False (the trainer's call): the buckets hold every bf16 gradient again
    assert ddp["ddp_gradient_buckets"] == QWEN3_8B.num_parameters() * 2
    # bf16 gradients add up in .grad under DDP: the fp32 sum is one process's
    assert one["fp32_gradient_sum"] == QWEN3_8B.num_parameters() * 4 and ddp["fp32_gradient_sum"] == 0
    lora = plan(QWEN3_8B, _job(dtype="bf16", lora_rank=16, gpus=8), H100)
    adapters = 16 * 36 * sum(a + b for a, b in QWEN3_8B.linear_shapes())
    assert lora["ddp_gradient_buckets"] == adapters * 4                        # fp32 adapters alone


@pytest.mark.parametrize("distributed", ["ddp", "fsdp2"])
def test_the_kl_reference_is_a_full_copy_on_every_rank(distributed):
    one = plan(QWEN3_8B, _job(beta=0.04), H100)
    many = plan(QWEN3_8B, _job(beta=0.04, gpus=8, distributed=distributed), H100)
    assert many["reference_model"] == one["reference_model"] == QWEN3_8B.num_parameters() * 4
    assert plan(QWEN3_8B, _job(beta=0.04, lora_rank=16, dtype="bf16", gpus=8,
                               distributed=distributed), H100)["reference_model"] == 0


@pytest.mark.parametrize("parallel", [2, 4])
def test_sequence_parallel_divides_the_micro_batch_by_its_ranks(parallel):
    # 2 sequences of 512 + 8192 tokens: 17408 tokens, a multiple of 2 and 4
    base = dict(gpus=4, distributed="fsdp2", loss="naive")
    one = plan(SHAPE, _job(**base), H100)
    split = plan(SHAPE, _job(**base, sequence_parallel=parallel), H100)
    assert split["activations"] * parallel == one["activations"]
    # the naive loss's buffers are a + b x tokens (a: the LM head's fp32 gradient); a rank's loss takes the
    # completion tokens it holds, at most its shard of the row (17408 / N tokens, all of them completion tokens on
    # the last ranks): b x tokens shrinks from 16384 completion tokens to that
    head_gradient = SHAPE.vocab_size * SHAPE.hidden_size * 4
    shard = 2 * (512 + 8192) // parallel
    assert (split["loss_buffers"] - head_gradient) * 16384 == (one["loss_buffers"] - head_gradient) * shard
    # what sequence parallelism adds, by its own formula: send and receive copies of q, k, v (2 key/value heads
    # repeated to 4 ranks) and the attention output of one layer's shard, and the (b, C, H) states of the loss
    head = SHAPE.hidden_size // SHAPE.num_heads
    exchanged = 2 * SHAPE.hidden_size + 2 * max(2, parallel) * head
    assert split["sp_all_to_all"] == 2 * shard * exchanged * 2
    assert split["sp_completion_states"] == 2 * 8192 * SHAPE.hidden_size * 2
    assert "sp_all_to_all" not in one
    # the model state does not depend on sequence parallelism (FSDP2 shards over all ranks alike)
    for name in MODEL_STATE + ("fsdp2_gathered",):
        assert split[name] == one[name], name


def test_heads_that_split_unevenly_exchange_the_larger_share():
    # Qwen2.5-7B's 28 heads over 8 ranks: 4 or 3 a rank; its 4 key/value heads repeated to one per query head
    shape = PRESETS["qwen2.5-7b"]
    job = _job(micro_batch_size=1, gpus=8, sequence_parallel=8, distributed="fsdp2")
    shard = -(-(512 + 8192) // 8)
    row, head = 8 * shard, 128
    q = shard * 28 + row * 4                     # q sent (every head of the shard), received (4 heads of the row)
    assert plan(shape, job, H100)["sp_all_to_all"] == 2 * (q + q) * head * 2


def test_a_sequence_parallel_row_that_does_not_split_evenly_is_padded():
    # 1 sequence of 512 + 8191 tokens over 4 ranks: each runs ceil(8703 / 4) = 2176 tokens
    job = _job(completion_length=8191, micro_batch_size=1, gpus=4, sequence_parallel=4, distributed="fsdp2")
    single = _job(completion_length=8191, micro_batch_size=1, gpus=4, distributed="fsdp2")
    per_token = plan(SHAPE, single, H100)["activations"] / 8703
    assert plan(SHAPE, job, H100)["activations"] == pytest.approx(2176 * per_token, rel=1e-12)


def test_sequence_parallel_turns_flash_attention_off():
    job = _job(gpus=2, sequence_parallel=2, dtype="bf16", distributed="fsdp2")
    assert job.attention_implementation == "grpo_fast_varlen"


def test_each_rank_holds_its_data_parallel_groups_share_of_the_step():
    # prompts_per_step 16 over gpus / sequence_parallel groups: 16, 8, 2 and 4 prompts a rank
    fields = dict(top_k=64, prompts_per_step=16, completion_length=2048, micro_batch_size=1)
    one = plan(SHAPE, Job(**fields), H100)
    sequences_one = 16 * 8
    generated = []
    for gpus, parallel, prompts in ((1, 1, 16), (2, 1, 8), (8, 1, 2), (8, 2, 4), (4, 4, 16)):
        job = Job(**fields, gpus=gpus, sequence_parallel=parallel, distributed="fsdp2")
        assert job.prompts_per_rank == prompts
        assert job.micro_batches_per_step == prompts * 8
        ranked = plan(SHAPE, job, H100)
        for name in ("step_batch", "kept_sets"):
            assert ranked[name] * sequences_one == one[name] * prompts * 8, (gpus, parallel, name)
        # the HF engine generates this rank's prompts in one call: a KV cache of its sequences at full length, in
        # the weights' dtype (fp32 under bf16-autocast), when its generation is the peak
        hf = plan(SHAPE, dataclasses.replace(job, engine="hf"), H100)
        kv = 2 * SHAPE.num_layers * SHAPE.kv_dim * prompts * 8 * (512 + 2048) * 4
        assert hf["kv_cache"] in (0, kv) and hf.generation_peak > kv, (gpus, parallel)
        generated.append(hf["kv_cache"])
    assert generated[0] and generated[-1]         # 16 prompts a rank: the generation is the peak


@pytest.mark.parametrize("fields, message", [
    (dict(gpus=8, sequence_parallel=3),
     "sequence_parallel 3 must divide the number of processes, got 8 (torchrun --nproc_per_node a multiple of 3)"),
    (dict(gpus=8, sequence_parallel=2, prompts_per_step=6),
     "prompts_per_step must be a multiple of the number of processes (4) so that each rank scores whole groups, "
     "got 6"),
    (dict(gpus=4, prompts_per_step=8, steps_per_generation=4),
     "steps_per_generation (4) cuts each process's 2 groups (prompts_per_step 8 over 4 processes) into mini-batches "
     "of whole groups: make prompts_per_step a multiple of 16, or change steps_per_generation"),
    (dict(gpus=2, sequence_parallel=2, packing=False),
     "sequence_parallel=2 cuts packed micro-batches across processes: set packing: true"),
    (dict(gpus=2, sequence_parallel=2, attention="sdpa"),
     "sequence_parallel=2 exchanges heads inside grpo_fast's packed attention: set attention: auto, got 'sdpa'"),
    (dict(gpus=2, max_staleness=1),
     "max_staleness=1 runs one rollout process for one trainer process; under torchrun (2 processes) use "
     "max_staleness: 0"),
    (dict(gpus=2, distributed="deepspeed"), "distributed must be one of ('ddp', 'fsdp2'), got 'deepspeed'"),
    (dict(gpus=0), "gpus must be >= 1, got 0"),
])
def test_the_trainers_refusals_in_its_words(fields, message):
    with pytest.raises(ValueError) as caught:
        Job(**{"prompts_per_step": 8, **fields})
    assert str(caught.value) == message


def test_heads_that_do_not_split_are_refused_as_the_attention_refuses_them():
    # spread_heads' rule, checked against its own refusal on tensors of the model's head counts
    torch = pytest.importorskip("torch")
    from grpo_fast.sequence_parallel import SequenceShards, spread_heads

    def attention_says(heads, kv_heads, size):
        query, key = torch.zeros(1, heads, 1, 4), torch.zeros(1, kv_heads, 1, 4)
        try:
            spread_heads(None, query, key, key, SequenceShards(None, size, 0))
        except Exception as error:          # past the head check the all-to-all needs a process group
            return str(error) if str(error).startswith("sequence_parallel") else None
        return None

    for heads, kv_heads, size in ((28, 4, 8), (28, 4, 4), (12, 2, 4), (12, 2, 3), (32, 8, 16), (32, 8, 8),
                                  (12, 3, 2), (9, 3, 2), (4, 2, 8), (12, 2, 16)):
        shape = ModelShape(64, 128, 2, heads, kv_heads, 1000, head_dim=8)
        job = Job(prompts_per_step=16, gpus=size, sequence_parallel=size, distributed="fsdp2")
        expected = attention_says(heads, kv_heads, size)
        if expected is None:
            check_heads(shape, job)
            plan(shape, job)
        else:
            with pytest.raises(ValueError) as caught:
                plan(shape, job)
            assert str(caught.value) == expected, (heads, kv_heads, size)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "grpo_fast.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_prints_one_gpus_plan_naming_the_gpus_the_ranks_and_the_wrapper():
    done = _cli("qwen3-8b", "--completion-length", "16384", "--gpus", "8", "--sequence-parallel", "8",
                "--distributed", "fsdp2", "--engine", "vllm", "--micro-batch-size", "1")
    assert done.returncode == 0, done.stderr
    assert ("per GPU: each of gpus 8, fsdp2 (weights, gradients and optimizer states sharded over the 8 ranks), "
            "sequence_parallel 8: 1 data-parallel group of 16 prompts a step, each micro-batch's tokens split over 8 "
            "ranks") in done.stdout
    expected = plan(QWEN3_8B, Job(completion_length=16384, prompts_per_step=16, micro_batch_size=1, gpus=8,
                                  sequence_parallel=8, distributed="fsdp2", group_size=8, engine="vllm",
                                  micro_batch_tokens=None))
    peak = [line for line in done.stdout.splitlines() if line.startswith("peak")][0]
    assert float(peak.split()[-1]) == round(expected["total"] / GIB, 2)
    one = _cli("qwen3-8b", "--completion-length", "16384", "--json", "--engine", "vllm")
    job = json.loads(one.stdout)["job"]
    assert (job["gpus"], job["sequence_parallel"], job["distributed"]) == (1, 1, "ddp")
    assert "per GPU: gpus 1, one process" in _cli("qwen3-8b").stdout


@pytest.mark.parametrize("args, message", [
    (("--gpus", "8", "--sequence-parallel", "3"), "sequence_parallel 3 must divide the number of processes, got 8"),
    (("--gpus", "8", "--prompts-per-step", "12"), "prompts_per_step must be a multiple of the number of processes "
                                                  "(8)"),
    (("--gpus", "32", "--sequence-parallel", "32"), "sequence_parallel 32 must be at most the model's 28 attention "
                                                    "heads"),
    (("--completion-length", "65536", "--gpus", "8", "--sequence-parallel", "4"),
     "set --rope-scaling to {\"rope_type\": \"yarn\", \"factor\": 3}"),
    (("--gpus", "0"), "--gpus must be >= 1, got 0"),
])
def test_cli_refuses_in_one_line(args, message):
    done = _cli("qwen2.5-7b", *args)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_rope_scaling_still_plans_past_the_context_with_the_new_options():
    yarn = '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}'
    done = _cli("qwen3-8b", "--completion-length", "130560", "--rope-scaling", yarn, "--gpus", "8",
                "--sequence-parallel", "8", "--distributed", "fsdp2", "--engine", "vllm", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["context"] == 131072 and report["job"]["sequence_parallel"] == 8
    past = _cli("qwen3-8b", "--completion-length", "131072", "--rope-scaling", yarn, "--gpus", "8",
                "--sequence-parallel", "8", "--distributed", "fsdp2")
    assert past.returncode == 2 and "beyond the model's context of 131072" in past.stderr


def test_a_training_config_gives_its_distribution_section(tmp_path):
    config = tmp_path / "sp.yaml"
    config.write_text("distribution:\n  sequence_parallel: 2\n  distributed: fsdp2\nrollout:\n  prompts_per_step: 4\n"
                      "  max_completion_length: 256\n")
    done = _cli(str(config), "--gpus", "4", "--json", "--device", "cuda")
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)["job"]
    assert (job["gpus"], job["sequence_parallel"], job["distributed"]) == (4, 2, "fsdp2")
    refused = _cli(str(config), "--sequence-parallel", "4")
    assert refused.returncode == 2
    assert "--sequence-parallel plans a preset or config.json" in refused.stderr
    odd = _cli(str(config), "--gpus", "3")
    assert odd.returncode == 2 and "sequence_parallel 2 must divide the number of processes, got 3" in odd.stderr
