"""`--enable-deterministic-inference`: a model's linears and RMSNorms on batch-invariant kernels.

Applied once at load, per model: the modules keep their parameters and change class, so the
forward code is unchanged and reads no global. Attention is the backend's part
(TritonAttnBackend(deterministic=True)); elementwise ops (rotary, SiLU gate, residual adds) are
row-wise already, and the embedding is a gather.
"""

from __future__ import annotations

import torch
from torch import nn

from eagleserve.kernels import batch_invariant as bi
from eagleserve.models.llama import LlamaForCausalLM, RMSNorm


class BatchInvariantLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bi.matmul(x, self.weight, self.bias)


class BatchInvariantRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bi.rms_norm(x, self.weight, self.eps)


def make_batch_invariant(model: nn.Module) -> int:
    """Switches every plain nn.Linear and RMSNorm of `model` (and a Llama's tied lm_head) to the
    batch-invariant kernels; returns how many modules changed. Packed (quantized) linears are
    not nn.Linear and stay as they are (they are a CPU path, row-invariant already)."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BatchInvariantLinear
            changed += 1
        elif type(module) is RMSNorm:
            module.__class__ = BatchInvariantRMSNorm
            changed += 1
        if isinstance(module, LlamaForCausalLM):
            module.batch_invariant = True
    return changed
