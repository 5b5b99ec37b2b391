"""verl's device layer on a CPU host, for tests, benchmarks and `main_ppo` without a GPU: verl 0.9's platform
registry knows nvidia, huawei and amd and falls back to "cuda" where it finds none, so its engines call torch.cuda
on a machine without one. Importing this registers a "cpu" platform (verl's PlatformBase, each method the CPU's
answer or a no-op) and selects it, and sets VERL_ENGINE_DEVICE=cuda where it is unset: verl's FSDP engine registers
for cuda and npu only, and runs on the CPU through this platform, over gloo.

In every process of a `main_ppo` job (the driver and each Ray worker) verl imports it itself when the environment
says `VERL_USE_EXTERNAL_MODULES=grpo_fast.integrations.verl_cpu` (Ray's workers inherit the driver's environment).
verl places its workers by Ray's "GPU" resource only (it counts no other): here that resource stands for a slot
of the CPU host, declared with `+ray_kwargs.ray_init.num_gpus=N`; Ray's CUDA_VISIBLE_DEVICES for it is inert
without CUDA. docs/verl.md ("verl on a CPU host") lists the job's other settings.
"""

import contextlib
import os
import resource

import torch
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase


def _resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # kilobytes on Linux


class CPUDeviceModule:
    """torch.cpu, with the torch.cuda functions verl calls on its device module that torch.cpu lacks: memory
    queries answer with this process's resident memory (now, or at its peak) and the host's free and total memory,
    caches and memory fractions are no-ops, the random state is torch's, the device's name is "cpu"."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def ipc_collect():
        pass

    @staticmethod
    def set_per_process_memory_fraction(fraction, device=None):
        pass

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def mem_get_info(device=None) -> tuple:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def memory_allocated(device=None) -> int:
        return _resident_bytes()

    memory_reserved = memory_allocated

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return _peak_resident_bytes()

    max_memory_reserved = max_memory_allocated

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)


@platform_manager.PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPUDeviceModule()

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
        # Ray refuses "CPU" as a custom resource, and verl's resource pool counts "GPU" (or "NPU") only
        return "GPU"

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


def _cpu_process_groups_and_offload() -> None:
    """Two of verl's CUDA assumptions, answered for the CPU in verl's own modules (before its workers import them):
    its process groups' backend string `cpu:gloo,<device>:<backend>` names the CPU twice here, which torch
    refuses, so it becomes `cpu:gloo`; and FSDP2's CPU offload of a forward-only model (verl's reference) pins
    memory, which needs a CUDA driver, so it offloads unpinned."""
    from verl.utils import distributed, fsdp_utils

    if getattr(distributed.initialize_global_process_group_ray, "cpu_host", False):
        return
    ray_group, torchrun_group = distributed.initialize_global_process_group_ray, \
        distributed.initialize_global_process_group

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return ray_group(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    def initialize_global_process_group(timeout_second=36000):
        init = torch.distributed.init_process_group
        torch.distributed.init_process_group = lambda backend=None, **kwargs: init(backend="cpu:gloo", **kwargs)
        try:
            return torchrun_group(timeout_second=timeout_second)
        finally:
            torch.distributed.init_process_group = init

    initialize_global_process_group_ray.cpu_host = True
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    distributed.initialize_global_process_group = initialize_global_process_group
    if fsdp_utils.CPUOffloadPolicy is not None:
        class UnpinnedCPUOffloadPolicy(fsdp_utils.CPUOffloadPolicy):
            def __init__(self, pin_memory: bool = True):
                super().__init__(pin_memory=False)

        fsdp_utils.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


os.environ["VERL_PLATFORM"] = "cpu"
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
platform_manager._current_platform = None       # resolve again, now to this one
_cpu_process_groups_and_offload()
