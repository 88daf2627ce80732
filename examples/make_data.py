"""Generate the small example datasets deterministically (committed; rerun to check).

`tiny.jsonl`: prompt/completion records of simple string transformations with strongly
ragged lengths (a 2-character word next to a 150-character sentence), so padding and
token-weighted loss normalization actually matter. `tiny-text.jsonl`: plain `{"text"}`
records of the same flavour. `tiny-eval.jsonl`: held-out prompts.

    python examples/make_data.py [--check]
"""

from __future__ import annotations

import json
import random

from datafiles import write_or_check

WORDS = ("ray lora tune adapter gradient batch micro step window token rank worker cluster queue "
         "kube job spec loss scale memory budget search accumulation sync bucket shard seed").split()


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


def build() -> dict[str, str]:
    rng = random.Random(1234)
    train = [record(rng) for _ in range(256)]
    evals = [record(rng) for _ in range(32)]
    texts = [{"text": f"{r['prompt']}{r['completion']}"} for r in train[:128]]
    dump = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    return {"tiny.jsonl": dump(train), "tiny-eval.jsonl": dump(evals), "tiny-text.jsonl": dump(texts)}


def main() -> None:
    write_or_check(build(), "make_data.py")


if __name__ == "__main__":
    main()
