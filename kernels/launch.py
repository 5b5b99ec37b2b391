"""Host-side helpers shared by the launchers: the device a launch runs on and the logit transform's constants."""

from contextlib import nullcontext
from typing import NamedTuple, Optional

import torch

# Rows of a logits buffer start on a 16-element boundary when the buffer's row stride is padded to it: the JIT
# then proves 16-byte alignment and issues vector loads and stores (grpo_fast.chunked.padded_width allocates
# buffers by the same rule; the kernels keep their own copy so as not to import the layer that calls them).
ROW_ALIGN = 16


class RowStats(NamedTuple):
    """What a stats pass (logprob_forward, kept_logprob_forward) returns, each (C,) fp32: the row's log-sum-exp,
    target log-prob, entropy and sum_v p_v^2 (None unless asked for), and the two numbers the gradient pass takes
    its probabilities from: row_max, the largest x of the row (the logit as the exponential sees it: +-y floored at
    -1e20, or tanh(y * scale / softcap)), and log_sum = ln(sum_v exp(z_v - z_max)) >= 0, so that
    p = exp((x - row_max) * dz/dx - log_sum) is exact to fp32 relative rounding however large lse is. A row with no
    finite logit has NaN lse, log-prob, entropy and log_sum."""

    lse: torch.Tensor
    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    sum_pi_squared: Optional[torch.Tensor]
    row_max: torch.Tensor
    log_sum: torch.Tensor

    @classmethod
    def empty(cls, num_rows: int, device, compute_entropy: bool, compute_sum_pi_squared: bool) -> "RowStats":
        def vector():
            return torch.empty(num_rows, dtype=torch.float32, device=device)

        return cls(vector(), vector(), vector() if compute_entropy else None,
                   vector() if compute_sum_pi_squared else None, vector(), vector())

    def pointers(self):
        """The six output pointers of a stats kernel, the lse standing in for those not computed (never written)."""
        return tuple(self.lse if t is None else t for t in self)


def padded_width(vocab_size: int) -> int:
    """The row stride, in elements, of a padded (C, V) buffer: V rounded up to ROW_ALIGN."""
    return -(-vocab_size // ROW_ALIGN) * ROW_ALIGN


def has_padding(logits: torch.Tensor) -> bool:
    """Whether every row of a (C, V) view is followed by its padding columns (up to `padded_width(V)`) in memory:
    a row stride of at least the padded width, also for a single row (a (1, V) slice of a contiguous tensor has
    its caller's next row right after it), and storage up to the last row's padding."""
    num_rows, vocab_size = logits.shape
    width = padded_width(vocab_size)
    if num_rows == 0 or width == vocab_size:
        return True
    end = logits.storage_offset() + (num_rows - 1) * logits.stride(0) + width
    return logits.stride(0) >= width and logits.untyped_storage().nbytes() >= end * logits.element_size()


def load_width(logits: torch.Tensor, padded: bool) -> int:
    """How many columns of each row a kernel may read and write: V, or the padded width when the caller owns the
    padding columns (scratch between V and the next row)."""
    if not padded:
        return logits.shape[1]
    assert has_padding(logits), "padded=True needs each row followed by its padding columns"
    return padded_width(logits.shape[1])


def compiled(kernel) -> bool:
    """Whether the kernel runs as compiled GPU code, i.e. not in Triton's CPU interpreter (TRITON_INTERPRET=1 at
    its decoration), which runs no inline PTX."""
    return type(kernel).__name__ != "InterpretedFunction"


def aligned_rows(logits: torch.Tensor) -> bool:
    """Whether every row of a (C, V) view starts on a 16-byte boundary, so that a kernel may read it in vectors."""
    return logits.data_ptr() % 16 == 0 and (logits.stride(0) * logits.element_size()) % 16 == 0


def on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's own for the launch."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else nullcontext()


def negates(softcap, in_scale: float) -> bool:
    """Whether the kernels take x = -y (a negative scale without a soft-cap), so that x increases with z: the stats
    and gradient passes must decide alike, since the gradient pass reads the stats pass's max of x."""
    return softcap is None and in_scale < 0


def transform_constants(scale: float, temperature: float, softcap):
    """(in_scale, out_scale, grad_scale) of `grpo_fast.kernels.transform.transform`, divisions done once here."""
    if softcap is None:
        return scale / temperature, 1.0, scale / temperature
    return scale / softcap, softcap / temperature, scale / temperature
