"""The wheel installs the kernels as grpo_fast.kernels (never a top-level `kernels`), and the CLI runs."""

import json
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_layout_and_import(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), ROOT], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("grpo_fast-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "grpo_fast/kernels/logprob_forward.py" in names and "grpo_fast/kernels/dlogits.py" in names
    assert "grpo_fast/integrations/liger.py" in names and "grpo_fast/benchmarks/harness.py" in names
    assert "grpo_fast/data/gsm8k_test_200.jsonl" in names and "grpo_fast/data/LICENSE-gsm8k" in names
    assert not any(name.startswith(("kernels/", "tests/", "benchmarks/")) for name in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = "import json, grpo_fast.kernels as k, grpo_fast as g; print(json.dumps([k.__file__, g.__file__]))"
    env = dict(os.environ, PYTHONPATH=str(target))
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    kernels_file, package_file = json.loads(done.stdout)
    assert kernels_file.startswith(str(target)) and package_file.startswith(str(target))


def test_demo_runs_both_implementations_and_agrees(capsys):
    from grpo_fast.benchmarks.demo import run

    rows = run(256, 32, 3000, "float32", "cpu", "torch", 1)
    assert all("error" not in r for r in rows), rows
    reference, fused = rows
    assert (reference["impl"], fused["impl"]) == ("reference", "grpo_fast")
    assert abs(fused["loss"] - reference["loss"]) <= 1e-5 * max(1.0, abs(reference["loss"]))
    assert fused["time_s"] > 0 and fused["peak_bytes"] >= 0
    assert "grpo_fast uses" in capsys.readouterr().out


def test_cli_rejects_unknown_command():
    done = subprocess.run([sys.executable, "-m", "grpo_fast.cli", "nonsense"], capture_output=True, text=True)
    assert done.returncode == 2 and "invalid choice" in done.stderr

