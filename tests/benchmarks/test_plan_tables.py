"""The planner's tables in docs/long-context-and-planner.md are what the planner says now: each regenerated from
its commands (benchmarks/plan_tables.py, benchmarks/fit_table.py) and found in the docs word for word, so that a
change of the planner that moves a documented number fails here until the docs follow."""

import os

from grpo_fast.benchmarks import fit_table, plan_tables

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "long-context-and-planner.md")


def documented() -> str:
    with open(DOCS) as f:
        return f.read()


def test_per_gpu_and_one_card_tables_are_the_planners():
    text = documented()
    for build in (plan_tables.per_gpu, plan_tables.one_card):
        commands = []
        table = "\n".join(build(commands))
        assert table in text, table
        assert all(words[0] in plan_tables.YARN for words in commands) and len(commands) >= 32


def test_fit_table_is_the_planners():
    table = fit_table.table()
    assert table in documented(), table
