"""benchmarks/trl_real_model.py's arithmetic and its results files: steps after the first only, the update as the
step less generation, every ratio against the TRL row of the same length, the drop-in's reward varying within a
group, and results already written kept unless --overwrite is given. (The measurement itself trains a real model
for minutes: its numbers are in benchmarks/results/cpu/trl_real_model.md.)"""

import argparse
import json

import pytest

from grpo_fast.benchmarks import harness, trl_real_model


def test_medians_skip_the_first_step():
    assert trl_real_model.median_after_first([100.0, 3.0, 5.0, 4.0]) == 4.0
    assert trl_real_model.median_after_first([7.0]) == 7.0          # a one-step run has nothing else to report


def test_digit_share_reward_reads_text_and_chat_completions():
    rewards = trl_real_model.digit_share_reward(["12ab", [{"role": "assistant", "content": "1 2 3"}], ""])
    assert rewards == [0.5, 0.6, 0.0]


def _row(runner, tokens, seconds, generation, peak, update_start=1000.0, update_peak=None, loss=0.25):
    update_peak = peak if update_peak is None else update_peak
    return {"job": "dropin", "runner": runner, "completion_tokens": tokens, "seconds": seconds,
            "update_seconds": seconds - generation, "steps_per_hour": 3600 / seconds, "peak_rss_mib": peak,
            "start_rss_mib": 800.0, "loss": loss, "completion_len": float(tokens), "generation_peak_rss_mib": 1500.0,
            "update_start_rss_mib": update_start, "update_peak_rss_mib": update_peak,
            "update_growth_rss_mib": update_peak - update_start}


def test_dropin_ratios_are_against_trls_row_of_the_same_length():
    rows = [_row("trl", 64, 10.0, 4.0, 3000.0), _row("fast_trl", 64, 9.0, 4.0, 2400.0),
            _row("trl", 1024, 100.0, 60.0, 6000.0), _row("fast_trl", 1024, 80.0, 60.0, 3000.0)]
    args = argparse.Namespace(steps=3, dropin_steps=2, dropin_prompts=2)
    table = trl_real_model.markdown({"dropin": rows}, args, "cmd")
    fast_64 = next(line for line in table.splitlines() if line.startswith("| 64 | FastGRPOTrainer"))
    fast_1024 = next(line for line in table.splitlines() if line.startswith("| 1024 | FastGRPOTrainer"))
    # update 5 s vs 6 s, step 9 vs 10, peak 2400 vs 3000; at 1024: update 20 vs 40, step 80 vs 100, peak 0.5
    assert "| 0.83x | 0.90x |" in fast_64 and "| 0.80x |" in fast_64
    assert "| 0.50x | 0.80x |" in fast_1024 and "| 0.50x |" in fast_1024


def test_the_update_growth_is_the_update_peak_less_its_start():
    # TRL's update starts at 2000 MiB and peaks at 6000; grpo_fast's starts at 2000 and peaks at 3000: the peaks
    # are 0.50x apart, what each update adds 1000 / 4000 = 0.25x
    rows = [_row("trl", 1024, 100.0, 60.0, 6000.0, update_start=2000.0),
            _row("fast_trl", 1024, 80.0, 60.0, 3000.0, update_start=2000.0)]
    table = trl_real_model.markdown({"dropin": rows}, argparse.Namespace(dropin_steps=2, dropin_prompts=2), "cmd")
    fast = next(line for line in table.splitlines() if line.startswith("| 1024 | FastGRPOTrainer"))
    assert fast.endswith("| 1500 | 3000 (2000) | 0.50x | 1000 | 0.25x |")


def test_the_gsm8k_trainer_job_is_smollm2_on_the_cpu():
    config = trl_real_model.trainer_config({"trainer_job": "gsm8k"})
    assert (config.policy.model, config.policy.device, config.rollout.prompts_per_step, config.rollout.group_size,
            config.rollout.max_completion_length) == ("smollm2-135m-instruct", "cpu", 8, 4, 128)
    assert config.scoring.rewards == ["accuracy"] and "<answer>" in config.data.system_prompt


def test_a_failed_row_is_named_and_has_no_ratio():
    rows = [{"runner": "grpo_fast", "engine": "vllm", "error": "exit 1: ImportError: no vllm"},
            {"runner": "trl", "engine": None, "seconds": 20.0, "update_seconds": 8.0, "steps_per_hour": 180.0,
             "completion_len": 17.0, "peak_rss_mib": 3000.0, "prompts": 8, "group_size": 4, "completion_tokens": 24}]
    table = trl_real_model.markdown({"trainer": rows}, argparse.Namespace(steps=4, trainer_job="arithmetic"), "cmd")
    assert "| 1 | grpo_fast | vllm | exit 1: ImportError: no vllm |" in table
    assert "| 1 | trl.GRPOTrainer | transformers generate | 20.00 | 12.00 | 8.00 | - | 180 | 1.00x |" in table


def test_the_weight_sync_is_the_median_after_the_first_step():
    rows = [{"runner": "grpo_fast", "engine": "vllm", "seconds": 10.0, "update_seconds": 6.0, "steps_per_hour": 360.0,
             "sync_seconds": [9.0, 2.0, 4.0, 3.0], "completion_len": 17.0, "peak_rss_mib": 3000.0},
            {"runner": "trl", "engine": None, "seconds": 20.0, "update_seconds": 8.0, "steps_per_hour": 180.0,
             "completion_len": 17.0, "peak_rss_mib": 3000.0, "prompts": 8, "group_size": 4, "completion_tokens": 24}]
    table = trl_real_model.markdown({"trainer": rows}, argparse.Namespace(steps=4, trainer_job="arithmetic"), "cmd")
    assert "| 1 | grpo_fast | vllm | 10.00 | 4.00 | 6.00 | 3.00 | 360 | 2.00x |" in table


def test_rounds_divide_by_trls_row_of_the_same_round_and_report_the_median():
    def row(runner, round_, seconds, engine=None, dtype=None):
        return {"runner": runner, "engine": engine, "round": round_, "seconds": seconds, "update_seconds": 1.0,
                "steps_per_hour": 3600 / seconds, "completion_len": 17.0, "peak_rss_mib": 3000.0, "prompts": 8,
                "group_size": 4, "completion_tokens": 24, "engine_dtype": dtype}

    # round 1: 10 s against 20 (2.00x); round 2: TRL first, 12 against 18 (1.50x); round 3: 10 against 30 (3.00x)
    rows = [row("grpo_fast", 1, 10.0, "vllm", "bfloat16"), row("trl", 1, 20.0), row("trl", 2, 18.0),
            row("grpo_fast", 2, 12.0, "vllm", "bfloat16"), row("grpo_fast", 3, 10.0, "vllm", "bfloat16"),
            row("trl", 3, 30.0)]
    assert trl_real_model.median_ratios(rows) == pytest.approx({"vllm": 2.0})
    args = argparse.Namespace(steps=4, trainer_job="gsm8k", rounds=3)
    table = trl_real_model.markdown({"trainer": rows}, args, "cmd")
    assert "| 2 | grpo_fast | vllm (bfloat16) | 12.00 | 11.00 | 1.00 | - | 300 | 1.50x |" in table
    assert "| 3 | grpo_fast | vllm (bfloat16) | 10.00 | 9.00 | 1.00 | - | 360 | 3.00x |" in table
    assert "the median over the rounds: vllm 2.00x." in table


def test_rounds_alternate_their_order(monkeypatch):
    calls = []
    monkeypatch.setattr(trl_real_model, "run_child", lambda spec, timeout: calls.append(spec["runner"]) or {})
    args = argparse.Namespace(trainer_job="arithmetic", trainer_engines=["vllm"], rounds=3, steps=2, timeout=1)
    rounds = [row["round"] for row in trl_real_model.trainer_rows(args)]
    assert calls == ["grpo_fast", "trl", "trl", "grpo_fast", "grpo_fast", "trl"] and rounds == [1, 1, 2, 2, 3, 3]


def test_shared_prompt_rows_are_named_and_divided_by_trls():
    rows = [_row("trl", 1024, 100.0, 60.0, 6000.0), _row("fast_trl", 1024, 80.0, 60.0, 3000.0),
            _row("fast_trl_shared", 1024, 70.0, 60.0, 2400.0)]
    table = trl_real_model.markdown({"dropin": rows}, argparse.Namespace(dropin_steps=3, dropin_prompts=2), "cmd")
    shared = next(line for line in table.splitlines() if "share_prompts=True" in line)
    assert shared.startswith("| 1024 | FastGRPOTrainer(share_prompts=True) | 70.00 | 10.00 | 0.25x | 0.70x |")


def test_results_are_written_once_unless_overwritten(tmp_path):
    parser = argparse.ArgumentParser()
    harness.refuse_to_overwrite(parser, str(tmp_path), "x", overwrite=False)       # nothing there yet
    harness.write_results(str(tmp_path / "new"), "x", "# table\n", {"rows": [1]})
    assert (tmp_path / "new" / "x.md").read_text() == "# table\n"
    assert json.loads((tmp_path / "new" / "x.json").read_text())["rows"] == [1]
    with pytest.raises(SystemExit):
        harness.refuse_to_overwrite(parser, str(tmp_path / "new"), "x", overwrite=False)
    harness.refuse_to_overwrite(parser, str(tmp_path / "new"), "x", overwrite=True)
    harness.write_results(str(tmp_path / "taken"), "trl_real_model", "", {})
    with pytest.raises(SystemExit):            # the benchmark's own command line refuses before measuring anything
        trl_real_model.main(["--parts", "trainer", "--out", str(tmp_path / "taken")])
