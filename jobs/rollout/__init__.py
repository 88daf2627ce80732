"""Online RL's data side (`objective.name: grpo`), by role:

    engine    what samples completions: `RolloutEngine` (the seam), `HFEngine` (in-process,
              `model.generate`), one seed per completion (`sample_seed`)
    rewards   `reward.functions` resolved and called as TRL calls them; their values checked
    record    TRL's rollout metrics of a step and `rollouts/step-NNNNNN.jsonl`

The GRPO objective (`jobs.objectives.grpo`) runs them each step; nothing here knows the loop.
"""
