"""Runner backends: the implementations of ``executor.runner.Runner`` and the
factory that chooses among them.

``torch_backend`` (the model's forward, CPU or eager CUDA), ``fused_cpu`` (the
fused C decoder), ``cuda_graphs`` (the persistent-buffer step runner with CUDA
graphs), ``tensor_parallel`` (rank 0's runner of a sharded model), ``head_graphs``
(an EAGLE head's draft steps from persistent buffers) and ``factory`` (the one
place that decides which of them runs a model).
"""
