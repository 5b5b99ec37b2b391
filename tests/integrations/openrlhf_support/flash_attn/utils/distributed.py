"""flash_attn.utils.distributed.all_gather: used by OpenRLHF's ring attention only, which needs flash-attn."""


def all_gather(input_, process_group):
    raise NotImplementedError("ring attention needs flash-attn's kernels (a CUDA machine)")
