"""The line torch.compile must not cross: DDP's communication runs eagerly."""

from __future__ import annotations

import torch

# Communication and bucket rebuilds run eagerly even inside torch.compile: traced,
# they would see fake tensors (no data pointer to hand to MPI). torch's own lazy
# form imports dynamo on the first call only (``import mpiring`` stays cheap).
outside_compile = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
