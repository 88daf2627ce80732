"""Generate the small example datasets deterministically (committed; rerun to check).

`tiny.jsonl`: prompt/completion records of simple string transformations with strongly
ragged lengths (a 2-character word next to a 150-character sentence), so padding and
token-weighted loss normalization actually matter. `tiny-text.jsonl`: plain `{"text"}`
records of the same flavour. `tiny-eval.jsonl`: held-out prompts. `tiny-pairs.jsonl` and
`tiny-pairs-eval.jsonl`: preference pairs `{"prompt", "chosen", "rejected"}` of the same tasks,
chosen the right answer and rejected a plausible wrong one (the words left in order, a count off
by one, the last word for the first), for DPO and the other preference objectives on tiny-llama.

    python examples/make_data.py [--check]
"""

from __future__ import annotations

import json
import random

from datafiles import write_or_check

WORDS = (
    "ray lora tune adapter gradient batch micro step window token rank worker cluster queue "
    "kube job spec loss scale memory budget search accumulation sync bucket shard seed"
).split()


def phrase(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def record(rng: random.Random) -> dict:
    # Lengths drawn from a heavy-tailed mix: mostly short, some very long.
    n = rng.choice([1, 1, 2, 3, 4, 6, 10, 18, 25])
    text = phrase(rng, n)
    task = rng.choice(["reverse", "upper", "count", "first"])
    if task == "reverse":
        return {"prompt": f"reverse: {text}\n=> ", "completion": " ".join(reversed(text.split()))}
    if task == "upper":
        return {"prompt": f"upper: {text}\n=> ", "completion": text.upper()}
    if task == "count":
        return {"prompt": f"count words: {text}\n=> ", "completion": str(len(text.split()))}
    return {"prompt": f"first word: {text}\n=> ", "completion": text.split()[0]}


def wrong(rec: dict) -> str:
    """A plausible wrong answer to `rec` (never its completion)."""
    words = rec["prompt"].split(": ", 1)[1].removesuffix("\n=> ").split()
    task = rec["prompt"].split(":", 1)[0]
    candidates = {
        "reverse": [" ".join(words), " ".join(words[1:] + words[:1])],
        "upper": [" ".join(words), " ".join(w.capitalize() for w in words)],
        "count words": [str(len(words) + 1), str(max(0, len(words) - 1))],
        "first word": [words[-1], words[len(words) // 2]],
    }[task]
    candidates += [w for w in WORDS if w != rec["completion"]]
    return next(c for c in candidates if c != rec["completion"])


def pairs(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        rec = record(rng)
        out.append({"prompt": rec["prompt"], "chosen": rec["completion"], "rejected": wrong(rec)})
    return out


def build() -> dict[str, str]:
    rng = random.Random(1234)
    train = [record(rng) for _ in range(256)]
    evals = [record(rng) for _ in range(32)]
    texts = [{"text": f"{r['prompt']}{r['completion']}"} for r in train[:128]]
    dump = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    pair_rng = random.Random(4321)  # its own stream: the files above stay as they were
    train_pairs, eval_pairs = pairs(pair_rng, 64), pairs(pair_rng, 16)
    return {
        "tiny.jsonl": dump(train),
        "tiny-eval.jsonl": dump(evals),
        "tiny-text.jsonl": dump(texts),
        "tiny-pairs.jsonl": dump(train_pairs),
        "tiny-pairs-eval.jsonl": dump(eval_pairs),
    }


def main() -> None:
    write_or_check(build(), "make_data.py")


if __name__ == "__main__":
    main()
