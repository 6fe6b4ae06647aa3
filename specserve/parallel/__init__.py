"""Tensor parallelism of the target (and of a draft model) on torch.distributed.

``plan`` (which slices a rank holds; pure Python), ``layers`` (row/column/vocabulary-
parallel pieces of the Llama model), ``loading`` (read only a rank's slices),
``shard`` (a rank's handle on a model: rank 0 broadcasts each step), ``group``
(process groups, the control link, failure detection), ``launch`` (which rank this
process is; starting the workers), ``worker`` (the workers' loop).  docs/parallelism.md.
"""
