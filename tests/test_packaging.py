"""Packaging: the wheel installs the kernels as grpo_fast.kernels (never a top-level `kernels`) and carries runtime
code only; the loss library imports nothing built on it; the CLI runs; the code passes the linter."""

import importlib.util
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
    assert "grpo_fast/train/tasks/data/gsm8k_test_200.jsonl" in names
    assert "grpo_fast/train/tasks/data/LICENSE-gsm8k" in names
    assert "grpo_fast/py.typed" in names                   # the entries' types reach type checkers
    assert "grpo_fast/train/loop.py" in names and "grpo_fast/benchmarks/demo.py" in names
    assert not any(name.startswith(("kernels/", "tests/", "benchmarks/")) for name in names)
    assert not any("bench_kernel_passes" in name or "/test_" in name for name in names)   # pytest-only code
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



OWN_ENVIRONMENT = {"grpo_fast.integrations.verl": "verl", "grpo_fast.integrations.verl_cpu": "verl",
                   "grpo_fast.integrations.openrlhf": "openrlhf"}


def library_modules() -> list:
    """Every module of the loss library: grpo_fast/ without the trainer (train/) and the command line (cli)."""
    modules = []
    for folder, _, files in os.walk(os.path.join(ROOT, "grpo_fast")):
        relative = os.path.relpath(folder, ROOT)
        if relative.split(os.sep)[:2] == ["grpo_fast", "train"] or "__pycache__" in relative:
            continue
        for name in sorted(files):
            if name.endswith(".py") and name != "cli.py":
                module = relative.replace(os.sep, ".") + ("" if name == "__init__.py" else "." + name[:-3])
                modules.append(module)
    return modules


def test_the_loss_library_imports_nothing_built_on_it():
    """The layers: no library module loads the trainer, the benchmark harness or the command line."""
    modules = library_modules()
    assert {"grpo_fast", "grpo_fast.loss", "grpo_fast.integrations.trl", "grpo_fast.backends"} <= set(modules)
    # an integration whose peer lives in its own environment (.ci/run) is imported there, by its own tests
    modules = [m for m in modules if m not in OWN_ENVIRONMENT or importlib.util.find_spec(OWN_ENVIRONMENT[m])]
    probe = ("import importlib, json, sys\n"
             f"for name in {modules!r}: importlib.import_module(name)\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[:2] in "
             "(['grpo_fast', 'train'], ['grpo_fast', 'benchmarks'], ['grpo_fast', 'cli']))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_code_passes_the_linter():
    """ruff, configured in pyproject.toml (line length, pyflakes, pycodestyle, import order)."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


def test_a_source_tree_without_an_install_says_how_to_install(tmp_path):
    """grpo_fast/ alone on sys.path (no install, so no grpo_fast.kernels or grpo_fast.benchmarks): the loss runs
    on the torch backend, and what needs the install fails with a message saying how to install."""
    import shutil

    shutil.copytree(os.path.join(ROOT, "grpo_fast"), tmp_path / "grpo_fast",
                    ignore=shutil.ignore_patterns("__pycache__"))
    probe = f"""
import sys
sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
sys.path.insert(0, {str(tmp_path)!r})
import torch, grpo_fast as gf
assert gf.__file__.startswith({str(tmp_path)!r}), gf.__file__
hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
loss, _ = gf.grpo_loss(hidden, weight, torch.randint(0, 11, (5,)), torch.ones(1), torch.ones(5),
                       execution=gf.Execution(backend="torch"))
assert torch.isfinite(loss)
import os
os.environ["TRITON_INTERPRET"] = "1"
try:
    gf.token_logprobs(hidden, weight, torch.zeros(5, dtype=torch.long), execution=gf.Execution(backend="triton"))
except ImportError as error:
    print("TRITON:", error, file=sys.stderr)
from grpo_fast.cli import main
sys.exit(main(["bench", "--quick"]))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "grpo-fast bench: the benchmark harness" in done.stderr
    assert "TRITON: backend='triton' needs grpo_fast.kernels" in done.stderr
    assert done.stderr.count("is importable only from an install: run `pip install -e .`") == 2


def test_the_repository_root_on_sys_path_does_not_shadow_hugging_faces_kernels(tmp_path):
    """From the repository's root (pytest, `python -m`), `import kernels` is Hugging Face's package where it is
    installed (transformers >= 5.25 requires and imports it), and an empty module without a version where it is
    not (transformers then finds no usable `kernels`); the repository's kernels/ folder stays grpo_fast.kernels."""
    import importlib.metadata

    code = ("import grpo_fast.kernels as ours\n"
            "import kernels\n"
            "print('found', kernels.__file__, hasattr(kernels, 'dlogits_') or hasattr(kernels, '__version__'))\n"
            "print('ours', ours.__file__, hasattr(ours, 'dlogits_'))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if installed:
        assert not lines["found"].startswith(os.path.join(ROOT, "kernels")), lines
    else:
        assert lines["found"] == os.path.join(ROOT, "kernels", "__init__.py") + " False", lines
    assert lines["ours"].endswith(os.path.join("kernels", "__init__.py") + " True"), lines


def test_the_kernel_tests_name_the_numpy_triton_36s_interpreter_needs():
    """Triton 3.6's CPU interpreter fails every kernel test on numpy 2.4 and later: the test run stops with one
    line naming the numpy it needs, and says nothing where the pair works."""
    from tests.helpers import interpreter_numpy_problem

    line = interpreter_numpy_problem("3.6.0", "2.4.6")
    assert line.startswith("Triton 3.6.0's CPU interpreter needs numpy < 2.4, and this environment has numpy 2.4.6")
    assert "\n" not in line
    assert interpreter_numpy_problem("3.6.0", "2.3.5") is None
    assert interpreter_numpy_problem("3.7.1", "2.4.6") is None
