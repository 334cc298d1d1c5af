"""What a run shows its user and its profiler: metrics.jsonl, TensorBoard events and sample
completions (`runlog`), named phases, trace windows, HLO dumps and compilation counts (`profile`).
The lowest folder: everything may use it.

May import: nothing of the package.
"""
