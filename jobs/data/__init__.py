"""Training data: sources -> checked records -> tokenized Examples in a shared on-disk cache ->
the global-batch sequence and micro-batch tensors.

One module per role, each importing only those above it:

    records     the record formats (`record_format`, the one place that tells them apart), their
                checks, `data.fields` renaming, and the cut that bounds a record (`char_bound`)
    chat        chat records through the model's chat template: rendering, loss spans, eval prompts
    sources     reading `data.path` / `data.eval_path` (JSONL line by line; JSON, Parquet, CSV,
                `save_to_disk` and `hf:` through `datasets`) into checked records; the held-out split
    tokenizing  records -> `Example`s (token ids and shifted labels, truncated to `max_seq_len`)
    cache       the tokenized cache: its format, key and content hashes, `TokenizedSplit`, and
                `load_dataset`, which builds an entry once and memory-maps it everywhere
    batches     `GlobalBatches` (step k -> its samples, independent of the split), `split_window`,
                `collate` (with packing), label/input counts, `total_steps`, `eval_shard`

Callers import from `jobs.data`; the names below are the package's interface.
"""

from .batches import (GlobalBatches, collate, count_inputs, count_labels, eval_shard, pack_rows, split_window,
                      total_steps)
from .cache import (CACHE_FORMAT, Dataset, TokenizedSplit, cache_key, content_hash, count_checked_records,
                    data_cache_dir, load_dataset, source_hash, tokenizer_hash)
from .chat import chat_prompt_ids, chat_spans
from .records import (OUR_FIELDS, ROLES, TEXT_FIELDS, char_bound, check_record, longest_token_chars,
                      record_format)
from .sources import DATASETS_SUFFIXES, is_hub, read_jsonl, read_records
from .tokenizing import IGNORE, Example, encode_prompt, tokenize, tokenize_iter

__all__ = [
    "CACHE_FORMAT", "DATASETS_SUFFIXES", "IGNORE", "OUR_FIELDS", "ROLES", "TEXT_FIELDS",
    "Dataset", "Example", "GlobalBatches", "TokenizedSplit",
    "cache_key", "char_bound", "chat_prompt_ids", "chat_spans", "check_record", "collate", "content_hash",
    "count_checked_records", "count_inputs", "count_labels", "data_cache_dir", "encode_prompt", "eval_shard",
    "is_hub", "load_dataset", "longest_token_chars", "pack_rows", "read_jsonl", "read_records", "record_format",
    "source_hash", "split_window", "tokenize", "tokenize_iter", "tokenizer_hash", "total_steps",
]
