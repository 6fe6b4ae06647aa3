"""``+method=mlp_speculator``: IBM's MLP speculator (the proposer:
``specserve.proposers.mlp_speculator``)."""

from __future__ import annotations

from specserve.methods import MethodSpec, register

register(MethodSpec(
    name="mlp_speculator",
    summary="MLP stages over the target's last hidden state, one per draft position",
    proposer="specserve.proposers.mlp_speculator:build",
    memory="specserve.proposers.mlp_speculator:memory",
    draft_probs=True,
    tree=True,
))
