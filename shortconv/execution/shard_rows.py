"""The row ranges a TP rank holds along a state bundle tensor's dim 2 (`execution.state_shards`).

Its own module, with no imports, because the model classes name it (`state_rows`) and
`state_shards` imports the model registry: one module holding both would close a cycle.
"""

Rows = tuple[tuple[int, int], ...]  # [start, stop) ranges along dim 2, in the shard's order
