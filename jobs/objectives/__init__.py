"""Training objectives: one interface (`Objective`, `base.py`), one module per kind of objective.

`Objective.of(spec)` is the objective a spec's `objective` section describes. Adding one is a spec
class in `jobs.spec` (its settings, defaults, documentation; a member of `ObjectiveSpec`) and a
module here whose class implements `Objective` and names that spec class in `specs`, imported
below so that it is registered.
"""

from .base import Objective
from .pair_losses import pair_losses, summed_stats
from .preference import REFERENCE_ADAPTER, PairObjective, PreferenceLoss
from .sft import SFT, CausalLMLoss

__all__ = [
    "REFERENCE_ADAPTER",
    "SFT",
    "CausalLMLoss",
    "Objective",
    "PairObjective",
    "PreferenceLoss",
    "pair_losses",
    "summed_stats",
]
