"""The ImportError of grpo_fast.integrations.verl / .openrlhf / .trl when their peer does not import: a missing
peer (or a module of its own) asks for the peer; a missing dependency of the peer is named, as one. The peers are
simulated (an import that fails as theirs would), so these run in every environment, with or without the peers."""

import importlib
import importlib.abc
import importlib.util
import re
import sys
import types

import pytest

# adapter: (the peer's top-level module, the message asking for the peer, the peer in words, how to install the
# peer's dependencies)
ADAPTERS = {
    "verl": ("verl", "grpo_fast.integrations.verl needs verl (pip install --no-deps 'verl==0.9.1', see "
                     "docs/verl.md)",
             "verl", "pip install -r requirements-verl.txt installs those verl 0.9.1 needs, as tested; see "
                     "docs/verl.md"),
    "openrlhf": ("openrlhf", "grpo_fast.integrations.openrlhf needs openrlhf (pip install --no-deps "
                             "'openrlhf==0.11.2', see docs/openrlhf.md)",
                 "OpenRLHF", "pip install -r requirements-openrlhf.txt installs those OpenRLHF 0.11.2 needs, as "
                             "tested; see docs/openrlhf.md"),
    "trl": ("trl", "grpo_fast.integrations.trl needs trl (pip install 'trl==1.16.0')",
            "trl", "pip install 'trl==1.16.0' installs those trl declares"),
}
# a dependency each peer imports (verl's engine modules: codetiming; OpenRLHF's trainer: ray; trl: accelerate)
DEPENDENCY = {"verl": "codetiming", "openrlhf": "ray", "trl": "accelerate"}


class FailingPeer(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the module `peer` and fails to execute it as a peer whose code imports the absent module `missing`
    does: ModuleNotFoundError("No module named ...", name=missing)."""

    def __init__(self, peer: str, missing: str):
        self.peer, self.missing = peer, missing

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.peer else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ModuleNotFoundError(f"No module named {self.missing!r}", name=self.missing)


def import_adapter(adapter, monkeypatch, *, failing=None):
    """Imports grpo_fast.integrations.<adapter> afresh, with `failing` (a FailingPeer) first on the import path;
    sys.modules and the import path come back as they were after the test."""
    monkeypatch.delitem(sys.modules, f"grpo_fast.integrations.{adapter}", raising=False)
    if failing is not None:
        monkeypatch.delitem(sys.modules, failing.peer, raising=False)
        monkeypatch.setattr(sys, "meta_path", [failing, *sys.meta_path])
    return importlib.import_module(f"grpo_fast.integrations.{adapter}")


def dependency_message(adapter, missing):
    _, _, peer, dependencies = ADAPTERS[adapter]
    return (f"grpo_fast.integrations.{adapter}: {peer} imports {missing!r}, which is not installed: a dependency of "
            f"{peer} is missing ({dependencies})")


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_a_missing_peer_asks_for_the_peer(adapter, monkeypatch):
    package, install, _, _ = ADAPTERS[adapter]
    monkeypatch.setitem(sys.modules, package, None)         # `import package`: No module named package
    with pytest.raises(ImportError, match=f"^{re.escape(install)}$") as info:
        import_adapter(adapter, monkeypatch)
    assert isinstance(info.value.__cause__, ModuleNotFoundError) and info.value.__cause__.name == package


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_a_missing_module_of_the_peer_itself_asks_for_the_peer(adapter, monkeypatch):
    """Another release of the peer, without a module the adapter imports: the peer is what to install."""
    package, install, _, _ = ADAPTERS[adapter]
    with pytest.raises(ImportError, match=f"^{re.escape(install)}$"):
        import_adapter(adapter, monkeypatch, failing=FailingPeer(package, f"{package}.workers.engine"))


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_a_missing_dependency_of_the_peer_is_named(adapter, monkeypatch):
    package, missing = ADAPTERS[adapter][0], DEPENDENCY[adapter]
    with pytest.raises(ImportError, match=f"^{re.escape(dependency_message(adapter, missing))}$") as info:
        import_adapter(adapter, monkeypatch, failing=FailingPeer(package, missing))
    assert isinstance(info.value.__cause__, ModuleNotFoundError) and info.value.__cause__.name == missing


def test_trl_lazy_import_of_a_missing_dependency_is_named(monkeypatch):
    """trl imports GRPOTrainer on first access and reports an ImportError there as a RuntimeError raised from it
    (trl._lazy_module); the dependency it names is still the one reported."""
    def lazy_attribute(name):
        try:
            raise ModuleNotFoundError("No module named 'datasets'", name="datasets")
        except ModuleNotFoundError as error:
            raise RuntimeError(f"Failed to import trl.trainer.grpo_trainer because of the following error (look up "
                               f"to see its traceback):\n{error}") from error

    fake = types.ModuleType("trl")
    fake.__getattr__ = lazy_attribute
    monkeypatch.setitem(sys.modules, "trl", fake)
    with pytest.raises(ImportError, match=f"^{re.escape(dependency_message('trl', 'datasets'))}$") as info:
        import_adapter("trl", monkeypatch)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_trl_runtime_error_that_is_not_an_import_passes_through(monkeypatch):
    """A RuntimeError from trl that no ImportError caused is trl's own failure: it propagates unchanged."""
    def broken(name):
        raise RuntimeError("trl failed for a reason of its own")

    fake = types.ModuleType("trl")
    fake.__getattr__ = broken
    monkeypatch.setitem(sys.modules, "trl", fake)
    with pytest.raises(RuntimeError, match="^trl failed for a reason of its own$"):
        import_adapter("trl", monkeypatch)
