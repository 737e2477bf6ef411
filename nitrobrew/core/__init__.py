"""The shared core every loss family builds on (and nothing family-specific):

- ``online``: the streaming log-sum-exp state ``Online`` (with the KLs' accumulators), spans of rows
  or vocab columns, the automatic vocab chunk, per-row upstream scales, (total, kd, ce) rows.
- ``slabs``: logits of a vocab range, their gradient into dX/dW/db, gradient buffers, gradients
  formed in the forward and handed out once.
- ``tl_utils``: Triton jit helpers (``row_terms``, ``row_grad``, online updates) and launch settings.
- ``outputs``: ``DistillOutput``.

With ``nitrobrew.core.checks`` (validation, reductions, backend choice, the double-backward guard),
``nitrobrew.core.ops`` (fp32-accumulating matmuls, softcap), ``nitrobrew.core.launch`` (Triton launch) and
``nitrobrew.divergences`` (the math). See docs/design.md §11 for what lives where.
"""
