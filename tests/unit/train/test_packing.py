"""Sample packing: rows without padding, positions restarting per sequence, no attention across
sequences -- and exactly the gradient of the padded layout."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from gradtools import build_engine, final_adapter, grads, rel_err, tiny_spec
from runs import metric_lines

from jobs.data import collate, load_dataset, pack_rows
from jobs.train.context import LocalContext
from jobs.train.loop import train


@pytest.mark.parametrize("seed", range(5))
def test_pack_rows_is_first_fit_decreasing_and_covers_every_sequence(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 40))]
    rows = pack_rows(lengths, 100)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 100 for row in rows)
    # first-fit decreasing never opens a row while an earlier one had room: any two rows
    # together are over capacity (else the later row's items would have fit the earlier one)
    fills = [sum(lengths[i] for i in row) for row in rows]
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            assert fills[a] + min(lengths[i] for i in rows[b]) > 100
    assert pack_rows(lengths, 100) == rows  # deterministic


def test_a_sequence_longer_than_the_capacity_gets_its_own_row():
    assert pack_rows([150, 30, 40], 100) == [[0], [1, 2]]


def _examples(micro: int, max_seq_len: int = 200):
    spec = tiny_spec(f"batch.micro_batch_size={micro}", f"data.max_seq_len={max_seq_len}")
    engine, model, tok = build_engine(spec)
    return spec, engine, model, tok, load_dataset(spec, tok).train


def test_packed_rows_restart_positions_and_keep_every_label():
    _, _, _, tok, train = _examples(8)
    ex = train[:8]
    padded = collate(ex, tok.pad_token_id)
    packed = collate(ex, tok.pad_token_id, pack_tokens=200, row_multiple=16)
    rows, T = packed["input_ids"].shape
    assert rows < len(ex) and T % 16 == 0 and T >= max(len(e.input_ids) for e in ex)
    # fewer computed positions than the padded layout, none of the labels lost
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    assert collections.Counter(packed["label_ids"].tolist()) == collections.Counter(padded["label_ids"].tolist())
    # every sequence appears once, contiguous, with positions 0..n-1 and its own segment id
    seen = []
    for r in range(rows):
        pos, seg, ids = packed["position_ids"][r], packed["seq_ids"][r], packed["input_ids"][r]
        for s in seg.unique().tolist():
            where = (seg == s).nonzero().squeeze(1)
            assert where.tolist() == list(range(int(where[0]), int(where[-1]) + 1))
            assert pos[where].tolist() == list(range(len(where)))
            seen.append(tuple(ids[where].tolist()))
    for e in ex:
        assert e.input_ids in seen
    assert "attention_mask" not in packed


def test_packing_that_saves_nothing_falls_back_to_the_plain_layout():
    _, _, _, tok, train = _examples(2)
    longest = sorted(train, key=lambda e: -len(e.input_ids))[:2]
    # two sequences that cannot share a row: one row each, so no mask and no position ids
    batch = collate(longest, tok.pad_token_id, pack_tokens=len(longest[0].input_ids) + 1)
    assert "seq_ids" not in batch and "position_ids" not in batch


def test_right_padding_without_a_mask_is_exact():
    """The plain layout passes no attention mask: causal attention already keeps real tokens
    from seeing the pads after them. Oracle: each sequence alone (no padding at all)."""
    spec, _, _, tok, train = _examples(8)
    ex = train[:8]
    assert len({len(e.input_ids) for e in ex}) > 3  # really ragged
    engine, model, _ = build_engine(spec)
    together = engine.module(**collate(ex, tok.pad_token_id))
    together.backward()
    want = grads(model)
    engine, model, _ = build_engine(spec)
    alone = sum(engine.module(**collate([e], tok.pad_token_id)) for e in ex)
    alone.backward()
    assert abs(together.item() - alone.item()) <= 1e-5 * abs(alone.item())
    assert rel_err(want, grads(model)) <= 1e-5


@pytest.mark.parametrize("gc", [False, True], ids=["plain", "checkpointing"])
def test_packed_gradient_equals_the_padded_gradient(gc):
    spec, _, _, tok, train = _examples(8)
    ex = train[:8]
    result = {}
    for name, kw in {"padded": {}, "packed": {"pack_tokens": 200, "row_multiple": 16}}.items():
        engine, model, _ = build_engine(spec, gc=gc)
        loss = engine.module(**collate(ex, tok.pad_token_id, **kw))
        loss.backward()
        result[name] = (loss.item(), grads(model))
    assert abs(result["packed"][0] - result["padded"][0]) <= 1e-5 * abs(result["padded"][0])
    assert rel_err(result["packed"][1], result["padded"][1]) <= 1e-5


def test_without_the_block_mask_packed_sequences_would_see_each_other():
    """The oracle above can fail: drop the block-diagonal mask (plain causal attention over the
    whole row, positions still restarting) and the gradient is far from the padded one."""
    spec, _, _, tok, train = _examples(8)
    ex = train[:8]
    engine, model, _ = build_engine(spec)
    engine.module(**collate(ex, tok.pad_token_id)).backward()
    want = grads(model)
    engine, model, _ = build_engine(spec)
    packed = collate(ex, tok.pad_token_id, pack_tokens=200)
    lm = model.get_base_model()
    T = packed["input_ids"].shape[1]
    causal_only = torch.zeros(1, 1, T, T).masked_fill_(
        ~torch.ones(T, T, dtype=torch.bool).tril_(), torch.finfo(torch.float32).min
    )
    hidden = lm.model(
        input_ids=packed["input_ids"], position_ids=packed["position_ids"], attention_mask=causal_only, use_cache=False
    ).last_hidden_state
    h = hidden.flatten(0, 1).index_select(0, packed["label_pos"])
    torch.nn.functional.cross_entropy(lm.lm_head(h), packed["label_ids"], reduction="sum").backward()
    assert rel_err(grads(model), want) > 1e-3


def test_a_packed_run_trains_exactly_like_a_padded_run(tmp_path):
    runs = {}
    for packing in (False, True):
        out = tmp_path / str(packing)
        spec = tiny_spec(
            "run.max_steps=3",
            "optim.lr=0.01",
            f"run.output_dir={out}",
            "batch.micro_batch_size=4",
            "data.eval_fraction=0.1",
            f"data.packing={str(packing).lower()}",
        )
        summary = train(spec, LocalContext(on_progress=lambda r: None), resume=False)
        runs[packing] = ([r["loss"] for r in metric_lines(out)], summary["eval_loss"], final_adapter(out))
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert abs(runs[True][1] - runs[False][1]) <= 1e-5 * abs(runs[False][1])
    assert rel_err(runs[True][2], runs[False][2]) <= 1e-5
    assert runs[True][0][0] != runs[True][0][-1]


def test_packing_is_refused_for_sliding_window_models_before_anything_starts(tmp_path, capsys):
    import yaml
    from gradtools import DATA
    from transformers import MistralConfig

    from orchestrator.cli import main

    model_dir = tmp_path / "mistral"
    MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        sliding_window=32,
    ).save_pretrained(model_dir)
    spec = {
        "name": "packed-mistral",
        "model": {"name": str(model_dir)},
        "data": {"path": str(DATA), "packing": True},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "run": {"max_steps": 1, "output_dir": str(tmp_path / "out")},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["run", str(path)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.packing: not supported for 'mistral'" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_flex_attention_packed_rows_see_what_the_float_bias_lets_them_see():
    """`model.attn_implementation: flex_attention` packs with a BlockMask built from the sequence
    slots (`jobs.objectives.sft.packed_block_mask`) instead of the float bias. Its backward runs on a GPU
    only (tests/gpu/test_gpu.py trains with it); here the forward: the packed loss through FlexAttention
    equals the packed loss through SDPA's bias and the padded loss, and a BlockMask that lets the
    sequences of a row see each other (plain causal over the row) does not."""
    from torch.nn.attention.flex_attention import create_block_mask

    spec, _, _, tok, train = _examples(8)
    ex = train[:8]
    packed = collate(ex, tok.pad_token_id, pack_tokens=200, row_multiple=16)
    assert packed["input_ids"].shape[0] < len(ex)  # several sequences share a row
    losses = {}
    for attn in ("sdpa", "flex_attention"):
        s = tiny_spec(
            "batch.micro_batch_size=8",
            "data.max_seq_len=200",
            f"model.attn_implementation={attn}",
            "resources.use_gpu=true",  # flex is refused for CPU jobs (no backward); the forward runs here
        )
        engine, _, _ = build_engine(s)
        with torch.no_grad():
            losses[attn] = engine.module(**packed).item()
            if attn == "flex_attention":
                losses["padded"] = engine.module(**collate(ex, tok.pad_token_id)).item()
                rows, T = packed["input_ids"].shape
                causal = create_block_mask(lambda b, h, q, kv: kv <= q, rows, None, T, T, device="cpu")
                lm = engine.module.model.get_base_model()
                hidden = lm.model(
                    input_ids=packed["input_ids"],
                    position_ids=packed["position_ids"],
                    attention_mask=causal,
                    use_cache=False,
                ).last_hidden_state
                h = hidden.flatten(0, 1).index_select(0, packed["label_pos"])
                leaky = torch.nn.functional.cross_entropy(lm.lm_head(h), packed["label_ids"], reduction="sum").item()
    assert abs(losses["flex_attention"] - losses["sdpa"]) <= 1e-5 * abs(losses["sdpa"])
    assert abs(losses["flex_attention"] - losses["padded"]) <= 1e-5 * abs(losses["padded"])
    assert abs(leaky - losses["sdpa"]) > 1e-3 * abs(losses["sdpa"])


def test_flex_attention_is_refused_for_a_cpu_job_in_one_line():
    from jobs.errors import SpecError

    with pytest.raises(SpecError, match="flex_attention needs resources.use_gpu=true") as err:
        tiny_spec("model.attn_implementation=flex_attention")
    assert "\n" not in str(err.value)
