"""Training data: sources -> checked records -> tokenized Examples (SFT) or Pairs (preference
objectives) in a shared on-disk cache -> the global-batch sequence and micro-batch tensors.

One module per role, each importing only those above it:

    records     the record formats (`record_format`, the one place that tells them apart), their
                checks, `data.fields` renaming, and the cut that bounds a record (`char_bound`)
    chat        chat records through the model's chat template: rendering, loss spans, eval prompts
    sources     reading `data.path` / `data.eval_path` (JSONL line by line; JSON, Parquet, CSV,
                `save_to_disk` and `hf:` through `datasets`) into checked records; the held-out split
    tokenizing  records -> `Example`s (token ids and shifted labels, truncated to `max_seq_len`)
    pairs       pair records -> `Pair`s (prompt, chosen and rejected ids; the truncation rule)
    cache       the tokenized cache: its format, key and content hashes, `TokenizedSplit`,
                `TokenizedPairs`, a mixture's entries side by side (`Concatenated`), and
                `load_dataset`, which builds an entry once and memory-maps it everywhere
    batches     `GlobalBatches` (step k -> its samples, independent of the split), `split_window`,
                `group_by_length`, label/input counts (`sample_counts`), `collate_at` (with
                packing) and `collate_pairs_at` (array copies from the cache's splits; `collate`,
                `collate_pairs` for lists), `total_steps`, `eval_shard`
    mixture     weighted mixtures (`data.mix`): `MixtureBatches` (step k -> its samples drawn by
                weight, each source with its own epochs), `batches_for`, per-source `step_metrics`
                (the sources side by side, `Concatenated`, are the cache's)
    preview     `data_preview`: the first samples as the loss sees them and the set's statistics,
                tokenized by the cache's own functions in memory (`rayft data preview`; import it
                from `jobs.data.preview`)

Callers import from `jobs.data`; the names below are the package's interface.
"""

from jobs.data.batches import (
    GlobalBatches,
    collate,
    collate_at,
    collate_pairs,
    collate_pairs_at,
    count_inputs,
    count_labels,
    equal_micro_batches,
    eval_shard,
    group_by_length,
    pack_rows,
    sample_counts,
    split_window,
    total_steps,
)
from jobs.data.cache import (
    CACHE_FORMAT,
    Dataset,
    cache_key,
    content_hash,
    count_checked_records,
    data_cache_dir,
    data_kind,
    load_dataset,
    source_hash,
    tokenizer_hash,
)
from jobs.data.chat import chat_pair_texts, chat_prompt_ids, chat_spans
from jobs.data.entry import Concatenated, Segments, SourcePart, TokenizedPairs, TokenizedSplit
from jobs.data.mixture import MixtureBatches, Sampler, batches_for, check_every_source_sampled, step_metrics
from jobs.data.pairs import DROP_EMPTY, DROP_IDENTICAL, Pair, tokenize_pairs, tokenize_pairs_iter, truncate_pair
from jobs.data.records import (
    OUR_FIELDS,
    PAIR,
    PAIR_FIELDS,
    PAIRS,
    ROLES,
    SFT,
    TEXT_FIELDS,
    char_bound,
    check_record,
    longest_token_chars,
    record_format,
    record_kind,
)
from jobs.data.sources import DATASETS_SUFFIXES, is_hub, read_jsonl, read_records
from jobs.data.tokenizing import IGNORE, Example, encode_prompt, tokenize, tokenize_iter

__all__ = [
    "CACHE_FORMAT",
    "Concatenated",
    "DATASETS_SUFFIXES",
    "DROP_EMPTY",
    "DROP_IDENTICAL",
    "IGNORE",
    "OUR_FIELDS",
    "PAIR",
    "PAIR_FIELDS",
    "PAIRS",
    "ROLES",
    "SFT",
    "Sampler",
    "Segments",
    "SourcePart",
    "TEXT_FIELDS",
    "Dataset",
    "Example",
    "GlobalBatches",
    "MixtureBatches",
    "Pair",
    "TokenizedPairs",
    "TokenizedSplit",
    "batches_for",
    "check_every_source_sampled",
    "cache_key",
    "char_bound",
    "chat_pair_texts",
    "chat_prompt_ids",
    "chat_spans",
    "check_record",
    "collate",
    "collate_at",
    "collate_pairs",
    "collate_pairs_at",
    "content_hash",
    "count_checked_records",
    "count_inputs",
    "count_labels",
    "data_cache_dir",
    "data_kind",
    "encode_prompt",
    "equal_micro_batches",
    "eval_shard",
    "group_by_length",
    "is_hub",
    "load_dataset",
    "longest_token_chars",
    "pack_rows",
    "read_jsonl",
    "read_records",
    "record_format",
    "record_kind",
    "sample_counts",
    "source_hash",
    "split_window",
    "step_metrics",
    "tokenize",
    "tokenize_iter",
    "tokenize_pairs",
    "tokenize_pairs_iter",
    "tokenizer_hash",
    "total_steps",
    "truncate_pair",
]
