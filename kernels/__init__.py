"""Kernel ops with one torch reference and one Triton implementation each
(kernels/triton_<op>.py), plus C++ CPU kernels for decode/verify attention,
for prompt-chunk attention and for the fused per-layer ops (RMSNorm with its
residual add, RoPE with the K/V store).

Dispatch by device: CUDA tensors run Triton; CPU tensors run the C++
kernels where their extensions build (kernels/cpu_paged_attention.py,
kernels/cpu_chunk_attention.py, kernels/cpu_fused_ops.py), the torch
reference otherwise, with one warning.
``AGENTKV_KERNELS=torch`` or ``=triton`` forces either (Triton on a CPU needs
``TRITON_INTERPRET=1`` set before triton is imported).

kernels/dispatch.py chooses among them, once a forward (select).
"""

if __name__ == "kernels":  # a bare import from the checkout, which must not shadow another package (PyPI's kernels)
    __import__("agentkv").step_aside(__name__)
