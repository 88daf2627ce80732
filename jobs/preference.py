"""Moved: the preference objectives are `jobs.objectives.preference` (the objective, its loss
module, the reference adapter) and `jobs.objectives.reference` (precomputed reference
log-probabilities). This name remains for bench/preference_reference.py, which imports it; remove
it once that script imports from there (and times `jobs.objectives.preference.precomputed_reference`)."""

from .objectives.preference import REFERENCE_ADAPTER, PreferenceLoss, active_adapter
from .objectives.reference import precomputed_reference, reference_key

__all__ = ["REFERENCE_ADAPTER", "PreferenceLoss", "active_adapter", "precomputed_reference", "reference_key"]
