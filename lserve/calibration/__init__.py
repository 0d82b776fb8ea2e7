"""Offline tools that write what the runtime reads: head-gate training (``classify-heads``),
the selection, prefill and budget calibrations, and the mass curves they start from.

They sit above the runtime: they drive the engine and the eval harness on generated prompts,
while the engine, attention, sparsity, models and serve never import this package (only the
file formats and readers, such as :mod:`lserve.sparsity.layer_select`, live below).
"""
