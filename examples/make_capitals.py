"""Generate the SmolLM2 task deterministically: a terse format the base model gets wrong.

Question "Capital of France?" -> answer exactly "Paris" (the city alone, nothing else). The
instruct model knows many capitals but answers in a sentence ("The capital of France is
Paris."), so exact match is ~0 before fine-tuning; the adapter has to learn the format and
apply it, with the base model's knowledge, to countries it never saw (the held-out split).

    python examples/make_capitals.py [--check]
"""

from __future__ import annotations

import json
import random

from datafiles import write_or_check

# The demo's files are chat records (`capitals-chat-*.jsonl`): rayft renders them with the model's
# own chat template (SmolLM2's, carried in its GGUF) for training and for `rayft eval` alike.
# The same task as prompt/completion records, with that template written out by hand (so this
# script needs no tokenizer), stays in `capitals-*.jsonl` for tests that feed a prompt as text.
TEMPLATE = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "United Kingdom": "London", "Ireland": "Dublin", "Belgium": "Brussels", "Netherlands": "Amsterdam",
    "Austria": "Vienna", "Switzerland": "Bern", "Poland": "Warsaw", "Czech Republic": "Prague",
    "Hungary": "Budapest", "Greece": "Athens", "Sweden": "Stockholm", "Norway": "Oslo", "Denmark": "Copenhagen",
    "Finland": "Helsinki", "Iceland": "Reykjavik", "Russia": "Moscow", "Ukraine": "Kyiv", "Romania": "Bucharest",
    "Bulgaria": "Sofia", "Serbia": "Belgrade", "Croatia": "Zagreb", "Turkey": "Ankara", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Morocco": "Rabat", "Ghana": "Accra",
    "South Africa": "Pretoria", "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi",
    "South Korea": "Seoul", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta",
    "Philippines": "Manila", "Malaysia": "Kuala Lumpur", "Pakistan": "Islamabad", "Iran": "Tehran",
    "Iraq": "Baghdad", "Saudi Arabia": "Riyadh", "Israel": "Jerusalem", "Afghanistan": "Kabul",
    "Australia": "Canberra", "New Zealand": "Wellington", "Canada": "Ottawa", "United States": "Washington",
    "Mexico": "Mexico City", "Cuba": "Havana", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Chile": "Santiago", "Peru": "Lima", "Colombia": "Bogota", "Venezuela": "Caracas", "Ecuador": "Quito",
    "Bolivia": "La Paz", "Uruguay": "Montevideo", "Paraguay": "Asuncion", "Nepal": "Kathmandu",
    "Bangladesh": "Dhaka", "Sri Lanka": "Colombo", "Mongolia": "Ulaanbaatar", "Syria": "Damascus",
    "Lebanon": "Beirut", "Jordan": "Amman", "Qatar": "Doha", "Tunisia": "Tunis", "Algeria": "Algiers",
    "Libya": "Tripoli", "Sudan": "Khartoum", "Uganda": "Kampala", "Tanzania": "Dodoma", "Senegal": "Dakar",
    "Zimbabwe": "Harare", "Zambia": "Lusaka", "Angola": "Luanda", "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana", "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius",
    "Belarus": "Minsk", "Georgia": "Tbilisi", "Armenia": "Yerevan", "Kazakhstan": "Astana",
    "Uzbekistan": "Tashkent", "Singapore": "Singapore", "Cambodia": "Phnom Penh", "Laos": "Vientiane",
    "Myanmar": "Naypyidaw", "Jamaica": "Kingston", "Panama": "Panama City", "Costa Rica": "San Jose",
    "Guatemala": "Guatemala City", "Honduras": "Tegucigalpa", "Nicaragua": "Managua",
    "Luxembourg": "Luxembourg", "Malta": "Valletta", "Cyprus": "Nicosia", "Albania": "Tirana",
}


def build() -> dict[str, str]:
    countries = sorted(CAPITALS)
    random.Random(2026).shuffle(countries)
    n_eval = 24
    rows = {
        "capitals-train.jsonl": countries[n_eval:],
        "capitals-eval.jsonl": countries[:n_eval],
    }
    out = {}
    for name, subset in rows.items():
        recs = [{"prompt": TEMPLATE.format(question=f"Capital of {c}?"), "completion": CAPITALS[c]}
                for c in subset]
        out[name] = "".join(json.dumps(r) + "\n" for r in recs)
        chats = [{"messages": [{"role": "user", "content": f"Capital of {c}?"},
                               {"role": "assistant", "content": CAPITALS[c]}]} for c in subset]
        out[name.replace("capitals-", "capitals-chat-")] = "".join(json.dumps(r) + "\n" for r in chats)
    return out


def tiny_chat() -> str:
    """`tiny-chat.jsonl` for examples/tiny-chat.yaml: two-turn conversations with a system prompt
    (tiny-llama learns the format, not the facts: it is random-initialized)."""
    rng = random.Random(7)
    countries = sorted(CAPITALS)
    lines = []
    for _ in range(64):
        a, b = rng.sample(countries, 2)
        msgs = [{"role": "system", "content": "Answer with the city only."},
                {"role": "user", "content": f"Capital of {a}?"}, {"role": "assistant", "content": CAPITALS[a]},
                {"role": "user", "content": f"And of {b}?"}, {"role": "assistant", "content": CAPITALS[b]}]
        lines.append(json.dumps({"messages": msgs}) + "\n")
    return "".join(lines)


def main() -> None:
    write_or_check({**build(), "tiny-chat.jsonl": tiny_chat()}, "make_capitals.py")


if __name__ == "__main__":
    main()
