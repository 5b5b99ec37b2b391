"""grpo_fast: the GRPO-family policy loss straight from hidden states, without the (tokens x vocab) logits."""

import os as _os

# From a source tree without an install, find the Triton kernels (kernels/ at the top level, installed as
# grpo_fast.kernels) the way the installed package lays them out.
_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "kernels")) and _os.path.isfile(
    _os.path.join(_here, _os.pardir, "kernels", "__init__.py")
):
    __path__.append(_os.path.join(_here, _os.pardir))  # noqa: F821

from grpo_fast.logprobs import token_logprobs  # noqa: E402
from grpo_fast.loss import GRPOLoss, grpo_loss  # noqa: E402
from grpo_fast.variants import LOSS_TYPES, LossConfig  # noqa: E402

__version__ = "0.1.0"
__all__ = ["token_logprobs", "grpo_loss", "GRPOLoss", "LossConfig", "LOSS_TYPES"]
