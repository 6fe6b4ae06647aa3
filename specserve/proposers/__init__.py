"""Draft proposers: one protocol (``base.Proposer``) and a registry keyed by method.

Importing this package registers the built-in proposers.
"""

from specserve.proposers import draft_model, eagle, ngram, suffix  # noqa: F401  (registration)
from specserve.proposers import dflash, layer_skip, mlp_speculator, mtp  # noqa: F401  (registration: issue #12's methods)
from specserve.proposers.base import PROPOSERS, DraftRequest, Proposal, Proposer, build_proposer

__all__ = ["PROPOSERS", "DraftRequest", "Proposal", "Proposer", "build_proposer"]
