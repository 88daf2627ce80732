"""Training objectives: one interface (`Objective`, `base.py`), one module per kind of objective.

`Objective.of(spec)` is the objective a spec's `objective` section describes. Adding one is a spec
class in `jobs.spec` (its settings, defaults, documentation; a member of `ObjectiveSpec`) and a
module here whose class implements `Objective` and names that spec class in `specs`, imported
below so that it is registered.
"""

from jobs.objectives.base import DatasetObjective, Objective, Window
from jobs.objectives.grpo import GRPO, GRPOLoss
from jobs.objectives.pair_losses import pair_losses, summed_stats
from jobs.objectives.preference import REFERENCE_ADAPTER, PairObjective, PreferenceLoss
from jobs.objectives.sft import SFT, CausalLMLoss

__all__ = [
    "GRPO",
    "GRPOLoss",
    "DatasetObjective",
    "Window",
    "REFERENCE_ADAPTER",
    "SFT",
    "CausalLMLoss",
    "Objective",
    "PairObjective",
    "PreferenceLoss",
    "pair_losses",
    "summed_stats",
]
