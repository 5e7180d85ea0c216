"""The core pass's fused steps as ``torch.library`` ops: see ``kernels/ops/`` (a torch
reference on CPU, a Triton kernel on CUDA)."""
