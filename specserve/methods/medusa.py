"""``+method=medusa``: Medusa heads over the target's last hidden state (the proposer:
``specserve.proposers.medusa``)."""

from __future__ import annotations

from specserve.methods import MethodSpec, register

register(MethodSpec(
    name="medusa",
    summary="Medusa heads over the target's last hidden state, one per draft position",
    proposer="specserve.proposers.medusa:build",
    memory="specserve.proposers.medusa:memory",
    draft_probs=True,
    tree=True,
))
