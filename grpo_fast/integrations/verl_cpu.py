"""verl's device layer on a CPU host, for tests and benchmarks without a GPU: verl 0.9's platform registry knows
nvidia, huawei and amd and falls back to "cuda" where it finds none, so its engines call torch.cuda on a machine
without one. Importing this registers a "cpu" platform (verl's PlatformBase, each method the CPU's answer or a
no-op) and selects it, and sets VERL_ENGINE_DEVICE=cuda where it is unset: verl's FSDP engine registers for cuda
and npu only, and runs on the CPU through this platform, over gloo."""

import contextlib
import os

import torch
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase


@platform_manager.PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"                       # verl moves micro-batches with .to(current_device())

    def device_count(self):
        return 1

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None

    def set_device(self, device_index): pass
    def synchronize(self, device_index=None): pass
    def set_allocator_settings(self, settings): pass
    def empty_cache(self): pass
    def profiler_start(self): pass
    def profiler_stop(self): pass


os.environ["VERL_PLATFORM"] = "cpu"
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
platform_manager._current_platform = None       # resolve again, now to this one
