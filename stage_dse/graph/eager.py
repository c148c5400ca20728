"""Element-wise ops as eager PyTorch runs them: each op of a layer's reference implementation
is its own kernel, reading its inputs from and writing its output to device memory.

A fused kernel (``torch.compile``'s Inductor, Transformer Engine's or Apex's hand-written
kernels) reads an RMSNorm's input once and writes its output once; eager PyTorch runs the
reference code op by op, in fp32 where the code upcasts, and autograd runs the backward of
each of those ops as kernels of their own. The graph keeps one op per logical element-wise
op; :func:`run_eagerly` scales its bytes to what the eager kernels move and records how many
kernels it launches. The factors are counts, not fits: HBM bytes per element of the op's
tensor with 16-bit activations, kernel by kernel, over the fused op's bytes in the graph
(:mod:`stage_dse.graph.forward`, :mod:`stage_dse.graph.backward`).

Reference implementations counted (torchtitan's Llama at 9dec370, 2024-12, as the Llama
models of Hugging Face transformers write them too):

* **RMSNorm** (``torchtitan/models/norms.py`` ``RMSNorm``: ``x.float()``, ``pow(2)``,
  ``mean(-1)``, ``+ eps``, ``rsqrt``, ``x * rsqrt``, ``type_as(x)``, ``* weight``). Forward
  6 + 8 + 4 + 8 + 6 + 4 = 36 bytes per element in 8 kernels, against 4 fused (read x, write
  y). Backward, autograd node by node: the weight product (grad times weight 4, the weight
  gradient's product and sum 8), the cast back to fp32 6, ``x * rsqrt`` (input gradient 8,
  the rsqrt gradient's product and row sum 16), the mean's expanded gradient 4, the square's
  gradient 20, the sum of the two input gradients 12, the cast to bf16 6: 84 bytes in 12
  kernels, against 6 fused (read dy and x, write dx).
* **Rotary embedding** (``apply_rotary_emb``: ``float()``, ``view_as_complex``, the complex
  product with ``freqs_cis``, ``view_as_real``, ``type_as``): 6 + 8 + 6 = 20 bytes per element
  in 3 kernels each way (views copy nothing), against 4 fused.
* **SwiGLU** (``F.silu(w1(x)) * w3(x)``): forward SiLU 4 and product 6 = 10 bytes per
  element of the hidden width in 2 kernels, against 6 fused; backward both product gradients
  (6 each, the SiLU output kept) and SiLU's 6 = 18 in 3 kernels, against 10 fused.

LayerNorm, GELU, softmax and dropout are single native kernels in eager PyTorch too, and a
residual add is one kernel either way: their factors are 1.
"""

from __future__ import annotations

import sympy as sp

from stage_dse.graph.core import Graph
from stage_dse.graph.ir import Phase

__all__ = ["EAGER", "run_eagerly"]

_R = sp.Rational
EAGER: dict[str, tuple[tuple[sp.Rational, int], tuple[sp.Rational, int]]] = {
    # element-wise kind: ((forward bytes factor, kernels), (backward bytes factor, kernels))
    "rmsnorm": ((_R(36, 4), 8), (_R(84, 6), 12)),
    "rope": ((_R(20, 4), 3), (_R(20, 4), 3)),
    "swiglu": ((_R(10, 6), 2), (_R(18, 10), 3)),
}
"""Eager bytes over fused bytes, and kernels launched, per element-wise kind and direction."""


def run_eagerly(graph: Graph, kinds: tuple[str, ...] | None = None) -> None:
    """Scale each element-wise op of ``graph`` to its eager kernels, and mark the graph as
    fusing nothing (in place). ``kinds``: only ops of these element-wise kinds (the others keep
    their fused kernels, and the graph its fusion of them)."""
    for op in graph.ops:
        kind = op.elementwise
        if kind is None or kind.name not in EAGER or (kinds and kind.name not in kinds):
            continue
        factor, kernels = EAGER[kind.name][op.phase is Phase.BACKWARD]
        op.bytes = op.bytes * factor
        op.kernels = kernels
    if not kinds:
        graph.fused_elementwise = False
