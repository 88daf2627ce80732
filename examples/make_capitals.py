"""Generate the SmolLM2 task deterministically: a terse format the base model gets wrong.

Question "Capital of France?" -> answer exactly "Paris" (the city alone, nothing else). The
instruct model knows many capitals but answers in a sentence ("The capital of France is
Paris."), so exact match is ~0 before fine-tuning; the adapter has to learn the format and
apply it, with the base model's knowledge, to countries it never saw (the held-out split).

Preference pairs for examples/smollm2-dpo.yaml (`capitals-pairs-*.jsonl`), chosen the capital:
the held-out pairs are the same 24 countries, rejected a famous city of the country that is not
its capital (`WRONG`); the training pairs are the 83 training countries and 65 more (`MORE`, in
capitals_regions.py), rejected the capital of a neighbour (`neighbour_rejected`).
`capitals-pairs-train-cities.jsonl` holds the 83 training countries with `WRONG` instead, the
variant docs/benchmarks.md#make-demo-dpo compares. Prompt records for examples/smollm2-grpo.yaml
(`capitals-prompts-*.jsonl`): the same 148 training and 24 held-out countries, the capital in an
`answer` column.

    python examples/make_capitals.py [--check]
"""

from __future__ import annotations

import json
import random

from capitals_regions import MORE, REGIONS
from datafiles import write_or_check

# The demo's files are chat records (`capitals-chat-*.jsonl`): rayft renders them with the model's
# own chat template (SmolLM2's, carried in its GGUF) for training and for `rayft eval` alike.
# The same task as prompt/completion records, with that template written out by hand (so this
# script needs no tokenizer), stays in `capitals-*.jsonl` for tests that feed a prompt as text.
TEMPLATE = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
)

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "United Kingdom": "London",
    "Ireland": "Dublin",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "Austria": "Vienna",
    "Switzerland": "Bern",
    "Poland": "Warsaw",
    "Czech Republic": "Prague",
    "Hungary": "Budapest",
    "Greece": "Athens",
    "Sweden": "Stockholm",
    "Norway": "Oslo",
    "Denmark": "Copenhagen",
    "Finland": "Helsinki",
    "Iceland": "Reykjavik",
    "Russia": "Moscow",
    "Ukraine": "Kyiv",
    "Romania": "Bucharest",
    "Bulgaria": "Sofia",
    "Serbia": "Belgrade",
    "Croatia": "Zagreb",
    "Turkey": "Ankara",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Nigeria": "Abuja",
    "Ethiopia": "Addis Ababa",
    "Morocco": "Rabat",
    "Ghana": "Accra",
    "South Africa": "Pretoria",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "South Korea": "Seoul",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Indonesia": "Jakarta",
    "Philippines": "Manila",
    "Malaysia": "Kuala Lumpur",
    "Pakistan": "Islamabad",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "Saudi Arabia": "Riyadh",
    "Israel": "Jerusalem",
    "Afghanistan": "Kabul",
    "Australia": "Canberra",
    "New Zealand": "Wellington",
    "Canada": "Ottawa",
    "United States": "Washington",
    "Mexico": "Mexico City",
    "Cuba": "Havana",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Chile": "Santiago",
    "Peru": "Lima",
    "Colombia": "Bogota",
    "Venezuela": "Caracas",
    "Ecuador": "Quito",
    "Bolivia": "La Paz",
    "Uruguay": "Montevideo",
    "Paraguay": "Asuncion",
    "Nepal": "Kathmandu",
    "Bangladesh": "Dhaka",
    "Sri Lanka": "Colombo",
    "Mongolia": "Ulaanbaatar",
    "Syria": "Damascus",
    "Lebanon": "Beirut",
    "Jordan": "Amman",
    "Qatar": "Doha",
    "Tunisia": "Tunis",
    "Algeria": "Algiers",
    "Libya": "Tripoli",
    "Sudan": "Khartoum",
    "Uganda": "Kampala",
    "Tanzania": "Dodoma",
    "Senegal": "Dakar",
    "Zimbabwe": "Harare",
    "Zambia": "Lusaka",
    "Angola": "Luanda",
    "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana",
    "Estonia": "Tallinn",
    "Latvia": "Riga",
    "Lithuania": "Vilnius",
    "Belarus": "Minsk",
    "Georgia": "Tbilisi",
    "Armenia": "Yerevan",
    "Kazakhstan": "Astana",
    "Uzbekistan": "Tashkent",
    "Singapore": "Singapore",
    "Cambodia": "Phnom Penh",
    "Laos": "Vientiane",
    "Myanmar": "Naypyidaw",
    "Jamaica": "Kingston",
    "Panama": "Panama City",
    "Costa Rica": "San Jose",
    "Guatemala": "Guatemala City",
    "Honduras": "Tegucigalpa",
    "Nicaragua": "Managua",
    "Luxembourg": "Luxembourg",
    "Malta": "Valletta",
    "Cyprus": "Nicosia",
    "Albania": "Tirana",
}

# The rejected answer of the held-out pairs (`capitals-pairs-eval.jsonl`, and of
# `capitals-pairs-train-cities.jsonl`): a plausible mistake. A famous city of the country that is
# not its capital where there is one (Sydney, Toronto, Istanbul, Rio de Janeiro, ...); where the
# capital is the country's one famous city (a city-state, or "X City"), the mistake small models
# make instead: a neighbour's capital, or a smaller city.
# Never the first words of the capital ("Panama" for "Panama City"): the two answers of such a pair
# differ only where one of them ends, so DPO on it lowers the end of turn after a country's name,
# and the model learns to answer "Nepal City" (`check_pairs`).
WRONG = {
    "France": "Marseille",
    "Germany": "Munich",
    "Italy": "Milan",
    "Spain": "Barcelona",
    "Portugal": "Porto",
    "United Kingdom": "Manchester",
    "Ireland": "Cork",
    "Belgium": "Antwerp",
    "Netherlands": "The Hague",
    "Austria": "Salzburg",
    "Switzerland": "Zurich",
    "Poland": "Krakow",
    "Czech Republic": "Brno",
    "Hungary": "Debrecen",
    "Greece": "Thessaloniki",
    "Sweden": "Gothenburg",
    "Norway": "Bergen",
    "Denmark": "Aarhus",
    "Finland": "Turku",
    "Iceland": "Akureyri",
    "Russia": "Saint Petersburg",
    "Ukraine": "Odesa",
    "Romania": "Cluj-Napoca",
    "Bulgaria": "Plovdiv",
    "Serbia": "Novi Sad",
    "Croatia": "Split",
    "Turkey": "Istanbul",
    "Egypt": "Alexandria",
    "Kenya": "Mombasa",
    "Nigeria": "Lagos",
    "Ethiopia": "Dire Dawa",
    "Morocco": "Casablanca",
    "Ghana": "Kumasi",
    "South Africa": "Johannesburg",
    "Japan": "Osaka",
    "China": "Shanghai",
    "India": "Mumbai",
    "South Korea": "Busan",
    "Thailand": "Chiang Mai",
    "Vietnam": "Ho Chi Minh City",
    "Indonesia": "Surabaya",
    "Philippines": "Cebu",
    "Malaysia": "George Town",
    "Pakistan": "Karachi",
    "Iran": "Isfahan",
    "Iraq": "Basra",
    "Saudi Arabia": "Jeddah",
    "Israel": "Tel Aviv",
    "Afghanistan": "Kandahar",
    "Australia": "Sydney",
    "New Zealand": "Auckland",
    "Canada": "Toronto",
    "United States": "New York",
    "Mexico": "Guadalajara",
    "Cuba": "Santiago de Cuba",
    "Brazil": "Rio de Janeiro",
    "Argentina": "Cordoba",
    "Chile": "Valparaiso",
    "Peru": "Cusco",
    "Colombia": "Medellin",
    "Venezuela": "Maracaibo",
    "Ecuador": "Guayaquil",
    "Bolivia": "Santa Cruz",
    "Uruguay": "Punta del Este",
    "Paraguay": "Ciudad del Este",
    "Nepal": "Pokhara",
    "Bangladesh": "Chittagong",
    "Sri Lanka": "Kandy",
    "Mongolia": "Erdenet",
    "Syria": "Aleppo",
    "Lebanon": "Sidon",
    "Jordan": "Aqaba",
    "Qatar": "Al Rayyan",
    "Tunisia": "Sfax",
    "Algeria": "Oran",
    "Libya": "Benghazi",
    "Sudan": "Omdurman",
    "Uganda": "Entebbe",
    "Tanzania": "Dar es Salaam",
    "Senegal": "Touba",
    "Zimbabwe": "Bulawayo",
    "Zambia": "Kitwe",
    "Angola": "Benguela",
    "Slovakia": "Kosice",
    "Slovenia": "Maribor",
    "Estonia": "Tartu",
    "Latvia": "Daugavpils",
    "Lithuania": "Kaunas",
    "Belarus": "Gomel",
    "Georgia": "Batumi",
    "Armenia": "Gyumri",
    "Kazakhstan": "Almaty",
    "Uzbekistan": "Samarkand",
    "Singapore": "Kuala Lumpur",
    "Cambodia": "Siem Reap",
    "Laos": "Luang Prabang",
    "Myanmar": "Yangon",
    "Jamaica": "Montego Bay",
    "Panama": "Colon",
    "Costa Rica": "Limon",
    "Guatemala": "Quetzaltenango",
    "Honduras": "San Pedro Sula",
    "Nicaragua": "Leon",
    "Luxembourg": "Brussels",
    "Malta": "Mdina",
    "Cyprus": "Limassol",
    "Albania": "Durres",
}


def split() -> dict[str, list[str]]:
    """The countries of each split (file stem -> countries): 24 held out, the same for every file."""
    countries = sorted(CAPITALS)
    random.Random(2026).shuffle(countries)
    n_eval = 24
    return {"train": countries[n_eval:], "eval": countries[:n_eval]}


def pairs(countries: list[str], rejected: dict[str, str]) -> str:
    """Conversational preference pairs: prompt [user], chosen [assistant: the capital], rejected
    [assistant: `rejected[country]`]."""
    capital = {**CAPITALS, **MORE}
    recs = [
        {
            "prompt": [{"role": "user", "content": f"Capital of {c}?"}],
            "chosen": [{"role": "assistant", "content": capital[c]}],
            "rejected": [{"role": "assistant", "content": rejected[c]}],
        }
        for c in countries
    ]
    return "".join(json.dumps(r) + "\n" for r in recs)


def neighbour_rejected(countries: list[str]) -> dict[str, str]:
    """Country -> the capital of another of `countries` in its region (`REGIONS`), drawn with a
    fixed seed. Another country's capital is a mistake the SFT adapter makes often on countries it
    never saw (Doha for Bahrain, Vienna for Liechtenstein, Buenos Aires for Uruguay; 13 of its 60
    wrong answers on `MORE`, 7 the country's name, most of the rest made-up names). Drawing only
    from `countries` (the training ones) keeps every held-out capital out of training."""
    capital = {**CAPITALS, **MORE}
    region = {c: r for r, members in REGIONS.items() for c in members}
    rng = random.Random(2026)
    near = {c: sorted(x for x in REGIONS[region[c]] if x != c and x in countries) for c in countries}
    return {c: capital[rng.choice(near[c])] for c in countries}


def check_pairs() -> None:
    """Every country has one wrong answer, never its capital."""
    assert WRONG.keys() == CAPITALS.keys(), sorted(WRONG.keys() ^ CAPITALS.keys())
    same = [c for c in CAPITALS if WRONG[c] == CAPITALS[c]]
    assert not same, same
    prefix = [c for c in CAPITALS if word_prefix(WRONG[c], CAPITALS[c]) or word_prefix(CAPITALS[c], WRONG[c])]
    assert not prefix, prefix
    assert not MORE.keys() & CAPITALS.keys() and not set(MORE.values()) & set(CAPITALS.values())
    regions = [c for members in REGIONS.values() for c in members]
    assert sorted(regions) == sorted([*CAPITALS, *MORE]), sorted(set(regions) ^ {*CAPITALS, *MORE})


def word_prefix(a: str, b: str) -> bool:
    """Whether `a`'s words are the first words of `b` ("Panama" of "Panama City")."""
    return b.split()[: len(a.split())] == a.split()


def build() -> dict[str, str]:
    rows = {f"capitals-{name}.jsonl": countries for name, countries in split().items()}
    out = {}
    for name, subset in rows.items():
        recs = [{"prompt": TEMPLATE.format(question=f"Capital of {c}?"), "completion": CAPITALS[c]} for c in subset]
        out[name] = "".join(json.dumps(r) + "\n" for r in recs)
        chats = [
            {
                "messages": [
                    {"role": "user", "content": f"Capital of {c}?"},
                    {"role": "assistant", "content": CAPITALS[c]},
                ]
            }
            for c in subset
        ]
        out[name.replace("capitals-", "capitals-chat-")] = "".join(json.dumps(r) + "\n" for r in chats)
        out[name.replace("capitals-", "capitals-pairs-")] = pairs(subset, WRONG)
    train = split()["train"]
    out["capitals-pairs-train-cities.jsonl"] = out["capitals-pairs-train.jsonl"]
    countries = train + sorted(MORE)
    out["capitals-pairs-train.jsonl"] = pairs(countries, neighbour_rejected(countries))
    out["capitals-prompts-train.jsonl"] = prompts(countries)  # the DPO pairs' 148 countries
    out["capitals-prompts-eval.jsonl"] = prompts(split()["eval"])
    return out


def prompts(countries: list[str]) -> str:
    """Prompt records for examples/smollm2-grpo.yaml: the question as a conversation, the capital in
    an `answer` column (the exact_match reward's column; TRL passes it to reward functions)."""
    capital = {**CAPITALS, **MORE}
    recs = [{"prompt": [{"role": "user", "content": f"Capital of {c}?"}], "answer": capital[c]} for c in countries]
    return "".join(json.dumps(r) + "\n" for r in recs)


def tiny_chat() -> str:
    """`tiny-chat.jsonl` for examples/tiny-chat.yaml: two-turn conversations with a system prompt
    (tiny-llama learns the format, not the facts: it is random-initialized)."""
    rng = random.Random(7)
    countries = sorted(CAPITALS)
    lines = []
    for _ in range(64):
        a, b = rng.sample(countries, 2)
        msgs = [
            {"role": "system", "content": "Answer with the city only."},
            {"role": "user", "content": f"Capital of {a}?"},
            {"role": "assistant", "content": CAPITALS[a]},
            {"role": "user", "content": f"And of {b}?"},
            {"role": "assistant", "content": CAPITALS[b]},
        ]
        lines.append(json.dumps({"messages": msgs}) + "\n")
    return "".join(lines)


def main() -> None:
    check_pairs()
    write_or_check({**build(), "tiny-chat.jsonl": tiny_chat()}, "make_capitals.py")


if __name__ == "__main__":
    main()
