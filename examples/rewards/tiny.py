"""Reward functions for examples/tiny-grpo.yaml, written as TRL's `GRPOTrainer` calls one:
`fn(prompts=..., completions=..., completion_ids=..., **the records' other columns)`, one float
(or None: not applicable) per completion."""


def letters(completions, **_):
    """The share of the completion's characters that are lowercase ASCII letters or spaces (0..1):
    the random tiny-llama writes bytes of every kind, so this differs within a group from the
    first step and the policy can climb it."""
    return [sum(c.islower() or c == " " for c in text) / max(1, len(text)) for text in completions]


def first_letters_match(completions, completion, **_):
    """The share of the expected answer's first characters the completion starts with (0..1)."""
    out = []
    for got, want in zip(completions, completion, strict=True):
        want = want.strip()
        n = 0
        while n < min(len(got), len(want)) and got[n] == want[n]:
            n += 1
        out.append(n / max(1, len(want)))
    return out
