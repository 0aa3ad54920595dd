"""Linear: an nn.Linear whose multiplication the backend may replace.

After loading, backends/prepare.py may set `method`, a callable `method(x, bias)` from
backends/linear_methods.py (our kernels, int8 weights, a oneDNN prepacked weight); the
layer itself knows nothing of the hardware.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    method = None  # set by the backend; None: F.linear on the weight as loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is not None:
            return self.method(x, self.bias)
        return F.linear(x, self.weight, self.bias)
