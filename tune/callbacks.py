"""Tune driver callbacks (imported only when a search runs: this module imports Ray Tune)."""

from __future__ import annotations

import sys

from ray.tune import Callback

from .plan import TIME_ATTR, describe


class Announce(Callback):
    """One line per trial start and end on stderr, with the trial's value of the search's metric.
    Its only state is the metric's name, so it pickles into the experiment state and comes back
    with `Tuner.restore`."""

    def __init__(self, metric: str = "eval_loss"):
        self.metric = metric

    def on_trial_start(self, iteration, trials, trial, **info):
        print(
            f"  start  {trial.trial_id}: {describe(trial.config['point'], trial.config['lr'])}",
            file=sys.stderr,
            flush=True,
        )

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        ev = r.get(self.metric)
        ev = "-" if ev is None else f"{ev:.4f}"
        if r.get("finished"):
            print(
                f"  done   {trial.trial_id}: {self.metric} {ev} after {r.get(TIME_ATTR)} samples",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"  stop   {trial.trial_id}: {self.metric} {ev} at {r.get(TIME_ATTR)} samples (ASHA: stopped early)",
                file=sys.stderr,
                flush=True,
            )

    def on_trial_error(self, iteration, trials, trial, **info):
        print(
            f"  failed {trial.trial_id}: {describe(trial.config['point'], trial.config['lr'])} (recorded, not retried)",
            file=sys.stderr,
            flush=True,
        )
