"""The project fuzzes itself (hypothesis), within a fixed budget: a fixed number of examples per property, drawn
the same way on every run (derandomized, no example database), so CI is repeatable. A failing example hypothesis
finds is kept as a regular test below (`test_kept_example_*`).

- The four entries (grpo_loss, GRPOLoss, token_logprobs, fused_token_loss) at random shapes, dtypes, masks (rows
  and batches of zeros included), loss types, clipping levels, logit transforms and chunk budgets: each equals the
  float64 full-logits reference, value and gradients.
- Option-group values (NaN, inf, out of range, wrong types) and misspelt keywords through the entries: a result
  equal to the reference, or one line naming the argument.
- Random corruptions of a run folder (a file cut short, emptied, swapped with another, replaced by a foreign one,
  removed): `grpo-fast train --resume` resumes, or refuses on one line.
"""

import contextlib
import io
import math
import os
import random
import shutil

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import grpo_fast as gf  # noqa: E402
from grpo_fast import reference  # noqa: E402
from grpo_fast.variants import LOSS_TYPES  # noqa: E402
from tests.helpers import as_float64, assert_close  # noqa: E402

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def loss_cases(draw):
    """(tensors, options) of one loss call: shapes, dtype, mask with empty rows, loss options, transform, chunks."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    vocab, width = draw(st.integers(2, 40)), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, seq, generator=gen) < draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    if draw(st.booleans()):
        mask[draw(st.integers(0, batch - 1))] = False                # a row of zeros
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets[~mask] = -100                                               # poison where masked
    scale = draw(st.sampled_from([0.5, 3.0, 12.0]))                    # flat to peaked distributions
    tensors = dict(hidden=torch.randn(batch, seq, width, generator=gen).to(dtype),
                   weight=(torch.randn(vocab, width, generator=gen) * scale / width ** 0.5).to(dtype),
                   targets=targets, mask=mask)
    loss_type = draw(st.sampled_from(sorted(LOSS_TYPES)))
    level = "sequence" if loss_type == "vespo" else draw(st.sampled_from(["token", "sequence"]))
    beta = draw(st.sampled_from([0.0, 0.04]))
    config = gf.LossConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                           epsilon_high=5.0 if loss_type == "cispo" else draw(st.sampled_from([0.2, 0.28])),
                           max_completion_length=seq if loss_type == "dr_grpo" else None,
                           entropy_coef=draw(st.sampled_from([0.0, 0.01])))
    old = torch.where(mask, -torch.rand(batch, seq, generator=gen) * 4, torch.inf)
    ref = torch.where(mask, -torch.rand(batch, seq, generator=gen) * 4, torch.inf) if beta else None
    transform = gf.LogitTransform(temperature=draw(st.sampled_from([1.0, 0.7])),
                                  softcap=draw(st.sampled_from([None, 5.0])))
    per_token = draw(st.booleans())
    advantages = torch.randn((batch, seq) if per_token else (batch,), generator=gen)
    chunk_bytes = draw(st.sampled_from([None, 8 * vocab, 4 * vocab * 3]))   # one row, three rows, the default
    return tensors, dict(config=config, transform=transform, advantages=advantages, old_logps=old, ref_logps=ref,
                         execution=gf.Execution(chunk_bytes=chunk_bytes, backend="torch"))


def loss_and_grads(fn, tensors, options):
    hidden = tensors["hidden"].clone().requires_grad_()
    weight = tensors["weight"].clone().requires_grad_()
    loss, _ = fn(hidden, weight, tensors["targets"], options["advantages"], tensors["mask"],
                 old_logps=options["old_logps"], ref_logps=options["ref_logps"], config=options["config"],
                 transform=options["transform"], execution=options["execution"])
    if not loss.requires_grad:                                         # nothing counted: no graph to the inputs
        return loss.detach(), torch.zeros_like(hidden), torch.zeros_like(weight)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight), allow_unused=True, materialize_grads=True))


def close(got, want, rtol, name):
    """got equals want within rtol of want's largest entry (an empty pair is equal)."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if want.numel():
        assert_close(got, want, rtol, atol=rtol * (1 + float(want.abs().max())), name=name)


def assert_equal_to_reference(actual, tensors, options, dtype):
    expected = loss_and_grads(reference.grpo_loss, as_float64(tensors),
                              {**options, "advantages": options["advantages"].double(),
                               "old_logps": options["old_logps"].double(),
                               "ref_logps": None if options["ref_logps"] is None else options["ref_logps"].double()})
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    for name, got, want in zip(("loss", "d(hidden)", "d(weight)"), actual, expected):
        close(got, want, rtol, name)


@settings(FUZZ, max_examples=60)
@given(loss_cases())
def test_grpo_loss_and_the_module_equal_the_float64_reference(case):
    tensors, options = case
    dtype = tensors["hidden"].dtype
    assert_equal_to_reference(loss_and_grads(gf.grpo_loss, tensors, options), tensors, options, dtype)
    module = gf.GRPOLoss(options["config"], transform=options["transform"], execution=options["execution"])

    def forward(hidden, weight, targets, advantages, mask, *, config, transform, execution, **rest):
        return module(hidden, weight, targets, advantages, mask, **rest)
    assert_equal_to_reference(loss_and_grads(forward, tensors, options), tensors, options, dtype)


@settings(FUZZ, max_examples=40)
@given(loss_cases())
def test_token_logprobs_and_fused_token_loss_equal_the_float64_reference(case):
    """token_logprobs (log-probs and entropies, and their gradients through random cotangents) and a token-separable
    fused_token_loss of them, against the float64 reference, over the masked tokens."""
    tensors, options = case
    mask, dtype = tensors["mask"], tensors["hidden"].dtype
    targets = torch.where(mask, tensors["targets"], 0)
    cotangent = torch.randn(mask.shape, generator=torch.Generator().manual_seed(mask.numel()), dtype=torch.float64)

    def run(hidden, weight, fused):
        hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            loss = gf.fused_token_loss(hidden, weight, targets, gf.autograd_token_loss(
                lambda logp, entropy, index: (logp * cotangent.reshape(-1)[index].to(logp.dtype)).sum()
                - 0.1 * entropy.sum()), mask=mask, with_entropy=True, transform=options["transform"],
                execution=options["execution"])
            values = loss
        else:
            logp, entropy = gf.token_logprobs(hidden, weight, targets, return_entropy=True,
                                              transform=options["transform"], execution=options["execution"])
            values = torch.cat([logp[mask], entropy[mask]])
            loss = (logp * cotangent.to(logp.dtype) * mask).sum() - 0.1 * (entropy * mask).sum()
        if not loss.requires_grad:
            return values.detach(), torch.zeros_like(hidden), torch.zeros_like(weight)
        return values.detach(), *torch.autograd.grad(loss, (hidden, weight), allow_unused=True,
                                                    materialize_grads=True)

    transform = options["transform"]
    exact_hidden = tensors["hidden"].double().requires_grad_()
    exact_weight = tensors["weight"].double().requires_grad_()
    logp, entropy = reference.token_logprobs(exact_hidden, exact_weight, targets, return_entropy=True,
                                             temperature=transform.temperature, logit_softcap=transform.softcap)
    loss = (logp * cotangent * mask).sum() - 0.1 * (entropy * mask).sum()
    grads = torch.autograd.grad(loss, (exact_hidden, exact_weight))
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    for fused, want_values in ((False, torch.cat([logp[mask], entropy[mask]])), (True, loss)):
        got = run(tensors["hidden"], tensors["weight"], fused)
        for name, value, want in zip(("values", "d(hidden)", "d(weight)"), got, (want_values.detach(), *grads)):
            close(value, want, rtol, f"{'fused' if fused else 'logprobs'} {name}")


# ------------------------------------------------------------------ bad values and misspelt keywords
NUMERIC_FIELDS = ["epsilon_low", "epsilon_high", "delta", "beta", "sapo_temperature_pos", "sapo_temperature_neg",
                  "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef",
                  "max_completion_length", "log_ratio_clamp", "kl_clamp"]
BAD_VALUES = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e30, "0.2", [0.2], None, True, 3])


def one_line_error(make):
    """The error `make()` raises (TypeError or ValueError), checked to be one line; None when it returns."""
    try:
        make()
    except (TypeError, ValueError) as error:
        assert "\n" not in str(error), str(error)
        return str(error)
    return None


@settings(FUZZ, max_examples=120)
@given(field=st.sampled_from(NUMERIC_FIELDS), value=BAD_VALUES, entry=st.sampled_from(["config", "keyword"]))
def test_a_bad_loss_option_is_a_one_line_error_naming_it_or_a_loss_equal_to_the_reference(field, value, entry):
    """Through LossConfig or as a grpo_loss keyword (a moved one: its error names where it lives now)."""
    tensors = as_float64(dict(hidden=torch.randn(2, 3, 4, dtype=torch.float64), weight=torch.randn(5, 4),
                           targets=torch.tensor([[0, 1, 2], [3, 4, 0]]), mask=torch.ones(2, 3, dtype=torch.bool)))
    extra = {"beta": 0.04} if field != "beta" else {}
    if entry == "keyword":
        error = one_line_error(lambda: gf.grpo_loss(**tensors, advantages=torch.ones(2), **{field: value}))
        assert error is not None and field in error and "config=LossConfig" in error, error
        return
    error = one_line_error(lambda: gf.LossConfig(**{field: value}, **extra))
    if error is not None:
        assert field in error, error
        return
    config = gf.LossConfig(**{field: value}, **extra)
    options = dict(config=config, transform=gf.LogitTransform(), advantages=torch.randn(2, dtype=torch.float64),
                   old_logps=-torch.rand(2, 3, dtype=torch.float64), execution=gf.Execution(backend="torch"),
                   ref_logps=-torch.rand(2, 3, dtype=torch.float64))
    actual = loss_and_grads(gf.grpo_loss, tensors, options)
    assert all(bool(torch.isfinite(t).all()) for t in actual), (field, value, actual)
    assert_equal_to_reference(actual, tensors, options, torch.float64)


GROUP_FIELDS = {"LogitTransform": ["temperature", "scale", "softcap"], "TokenWeights": ["num_items_in_batch"],
                "Execution": ["chunk_bytes", "backend", "process_group"]}


@settings(FUZZ, max_examples=80)
@given(group=st.sampled_from(sorted(GROUP_FIELDS)), data=st.data(), value=BAD_VALUES)
def test_a_bad_option_group_value_is_a_one_line_error_naming_the_field(group, data, value):
    field = data.draw(st.sampled_from(GROUP_FIELDS[group]))
    error = one_line_error(lambda: getattr(gf, group)(**{field: value}))
    if error is None:                                  # accepted: a value in range (1e30 chunk bytes, 3, None, ...)
        return
    named = {"scale": "logit_scale", "softcap": "logit_softcap"}.get(field, field)
    assert named in error and f"{group}.{field}" in error, error


ENTRY_KEYWORDS = {"grpo_loss": ["old_logps", "ref_logps", "bias", "config", "transform", "weights", "execution"],
                  "token_logprobs": ["bias", "transform", "execution", "return_entropy"],
                  "fused_token_loss": ["mask", "bias", "transform", "execution", "with_entropy"]}


@st.composite
def misspellings(draw):
    entry = draw(st.sampled_from(sorted(ENTRY_KEYWORDS)))
    word = draw(st.sampled_from(ENTRY_KEYWORDS[entry] + ["temperature", "chunk_bytes", "loss_type", "kept_ids"]))
    at = draw(st.integers(0, len(word) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap", "case"]))
    if how == "drop":
        spelt = word[:at] + word[at + 1:]
    elif how == "double":
        spelt = word[:at] + word[at] + word[at:]
    elif how == "swap" and at + 1 < len(word):
        spelt = word[:at] + word[at + 1] + word[at] + word[at + 2:]
    else:
        spelt = word.upper()
    return entry, spelt


@settings(FUZZ, max_examples=80)
@given(misspellings())
def test_a_misspelt_keyword_is_a_one_line_type_error_naming_it(case):
    entry, spelt = case
    hidden, weight, targets = torch.randn(2, 4), torch.randn(5, 4), torch.tensor([1, 2])
    calls = {"grpo_loss": lambda **kw: gf.grpo_loss(hidden, weight, targets, torch.ones(2),
                                                    torch.ones(2, dtype=torch.bool), **kw),
             "token_logprobs": lambda **kw: gf.token_logprobs(hidden, weight, targets, **kw),
             "fused_token_loss": lambda **kw: gf.fused_token_loss(
                 hidden, weight, targets, gf.autograd_token_loss(lambda logp, entropy, index: logp.sum()), **kw)}
    if spelt in ENTRY_KEYWORDS[entry]:                 # the spelling happened to be right
        return
    try:
        calls[entry](**{spelt: None})
    except TypeError as error:
        message = str(error)
        assert "\n" not in message and f"{entry}() got " in message and spelt in message, message
    else:
        pytest.fail(f"{entry}({spelt}=None) was accepted")


# ------------------------------------------------------------------ corrupted run folders
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    pytest.importorskip("transformers")
    from grpo_fast.cli import main as cli

    folder = tmp_path_factory.mktemp("fuzz") / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli(["train", "--output-dir", str(folder), *RUN, "--max-steps", "2"]) == 0
    return folder


RUN = ["--sft-steps", "0", "--eval-every", "0", "--group-size", "2", "--prompts-per-step", "2", "--save-every", "1"]
CORRUPTIONS = ["truncate", "empty", "swap", "foreign", "remove"]


@settings(FUZZ, max_examples=24, suppress_health_check=[*FUZZ.suppress_health_check,
                                                        HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(CORRUPTIONS), seed=st.integers(0, 2**16))
def test_a_corrupted_run_folder_resumes_or_is_refused_on_one_line(finished_run, tmp_path_factory, how, seed):
    from grpo_fast.cli import main as cli

    chooser = random.Random(seed)
    run = tmp_path_factory.mktemp("corrupt") / "run"
    shutil.copytree(finished_run, run)
    files = sorted(os.path.relpath(os.path.join(root, name), run) for root, _, names in os.walk(run)
                   for name in names)
    target = run / chooser.choice(files)
    if how == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[:chooser.randrange(max(1, len(data)))])
    elif how == "empty":
        target.write_bytes(b"")
    elif how == "swap":
        other = run / chooser.choice(files)
        first, second = target.read_bytes(), other.read_bytes()
        target.write_bytes(second)
        other.write_bytes(first)
    elif how == "foreign":
        target.write_bytes(chooser.choice([b"\x00" * 64, b"not what you think\n", b'{"step": "two"}\n',
                                           bytes(chooser.randrange(256) for _ in range(200))]))
    else:
        target.unlink()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(["train", "--output-dir", str(run), *RUN, "--max-steps", "3", "--resume"])
    lines = [line for line in err.getvalue().splitlines() if line.startswith("grpo-fast train:")]
    assert code in (0, 2), (how, target, code, err.getvalue()[-2000:])
    if code == 2:
        assert len(lines) == 1 and "Traceback" not in err.getvalue(), (how, target, err.getvalue()[-2000:])
    else:
        assert os.path.isdir(run / "checkpoint-3"), (how, target)



# ------------------------------------------------------------------ examples the properties found, kept
def resume(run) -> tuple:
    from grpo_fast.cli import main as cli

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli(["train", "--output-dir", str(run), *RUN, "--max-steps", "3", "--resume"])
    return code, err.getvalue()


def test_kept_example_metrics_swapped_with_the_export_record(finished_run, tmp_path):
    """how='swap', seed=5235: metrics.jsonl held {"step": 2} (grpo_fast_export.json's line), a step's line with no
    reward: the resumed run finished, then its summary raised KeyError 'reward' (a traceback). It resumes and sums
    up the steps that have a reward."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    code, err = resume(run)
    assert code == 0 and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("line", ['[1, 2]', '"text"', '{"reward": 1.0}', '{"step": "2"}'])
def test_kept_example_a_line_that_is_no_steps_record_is_one_line(finished_run, tmp_path, line):
    """A metrics line that is JSON but no record of a step (another file's, or hand-written) before the last
    line: refused naming the file and the line (a list gave AttributeError, a missing step was kept)."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "metrics.jsonl").write_text(line + "\n" + (run / "metrics.jsonl").read_text())
    code, err = resume(run)
    assert code == 2 and err.strip() == f"grpo-fast train: {run / 'metrics.jsonl'}:1: not a line this run wrote (a " \
        "JSON object with its step); fix or remove it to resume", err[-2000:]
