"""The GPU's kernels in Triton, each op beside a plain PyTorch reference with the same signature:
paged attention (`paged_attention`), tree attention (`tree_attention`), KV-cache writes and
compaction (`kv_write`). specserve.kernels dispatches between the two by device.

`_triton` is the one guarded import of Triton (absolute: the package of that name, never this
one); without it the kernels' modules still import and their references still run.
"""
