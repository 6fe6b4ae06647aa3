"""``+method=mtp``: the target's own multi-token-prediction layers (the proposer:
``specserve.proposers.mtp``)."""

from __future__ import annotations

from specserve.methods import MethodSpec, register

register(MethodSpec(
    name="mtp",
    summary="the multi-token-prediction layers inside the target's checkpoint",
    proposer="specserve.proposers.mtp:build",
    memory="specserve.proposers.mtp:memory",
    needs_model=False,
    draft_probs=True,
    tree=True,
))
