"""The trainer's layout promises, read from the source with `ast`: each stage takes the config sections it reads, so
a signature says what the stage depends on; the whole TrainConfig goes only where it is saved, compared, checked
as a whole or handed on to the stages (at most 15 functions, named here: a new one is a decision, not a drift);
and the model is unwrapped only where a PEFT model's base is what gets saved."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "grpo_fast", "train")

# function -> why it takes the whole TrainConfig
WHOLE_CONFIG = {
    "config.py:_check_across_sections": "checks keys of several sections against each other",
    "loop.py:train": "the loop: hands each stage its sections",
    "loop.py:start_processes": "checks the config against the number of processes (check_world)",
    "loop.py:load_data": "setup: hands the task, evaluation and reward sections on",
    "loop.py:load_policy": "setup: hands the policy, data, warm-start and rollout sections on",
    "loop.py:open_outputs": "saved: the trackers record the whole config",
    "plan/fit.py:training_job": "the planner: the job the whole config describes",
    "plan/fit.py:fit_advice": "the planner: compares the config with changed copies of it",
    "plan/fit.py:log_run_plan": "the planner: hands the config to training_job and fit_advice",
    "rollout/__init__.py:start_rollouts": "hands the engine and the rollout process their sections",
    "rollout/__init__.py:start_process": "hands the rollout process its sections and the model's folder",
    "rollout/engines.py:make_engine": "builds the configured engine (also for `grpo-fast eval`)",
    "saved/checkpoint.py:training_state": "saved: the checkpoint holds the whole config",
    "saved/checkpoint.py:resume_changes": "compared: a resumed run's config against the checkpoint's",
    "saved/checkpoint.py:resume_point": "compared: hands the config to resume_changes",
}


def functions_with_config() -> set:
    """'file:function' of each function under grpo_fast/train/ with a parameter named `config`."""
    found = set()
    for directory, _, names in os.walk(TRAIN):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as source:
                tree = ast.parse(source.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                    if any(argument.arg == "config" for argument in arguments):
                        found.add(f"{os.path.relpath(path, TRAIN)}:{node.name}")
    return found


def test_only_the_listed_functions_take_the_whole_config():
    found = functions_with_config()
    assert found == set(WHOLE_CONFIG), (f"new: {sorted(found - set(WHOLE_CONFIG))}; "
                                        f"gone: {sorted(set(WHOLE_CONFIG) - found)}")
    assert len(WHOLE_CONFIG) <= 15


def test_the_trainer_unwraps_the_model_only_where_a_peft_base_is_saved():
    calls = []
    for directory, _, names in os.walk(TRAIN):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as source:
                    tree = ast.parse(source.read(), path)
                calls += [os.path.relpath(path, TRAIN) for node in ast.walk(tree) if isinstance(node, ast.Call)
                          and getattr(node.func, "id", getattr(node.func, "attr", None)) == "unwrap"]
    assert sorted(calls) == ["lora.py", "run/model_folder.py"], calls
