"""Draft proposers: one protocol (``base.Proposer``) and one module per method.

Which methods exist is the method registry's (``specserve.methods``); a proposer
module is imported when its method is built (``build_proposer``), not here.
"""

from specserve.proposers.base import DraftRequest, Proposal, Proposer, build_proposer

__all__ = ["DraftRequest", "Proposal", "Proposer", "build_proposer"]
