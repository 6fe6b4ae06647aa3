"""Draft-head training (``specserve-train``): EAGLE-3 heads for any target specserve serves.

``config`` (schema), ``capture`` (responses regenerated through the engine, features
captured in the same forwards), ``ttt`` (the training-time-test loss), ``trainer``
(vocabulary, training loop, checkpoints, export, evaluation), ``cli`` (entry point).
"""
