"""`rayft data ...`: the job's data before it is trained on.

    rayft data preview SPEC [k=v ...] [-n N] [--tokens] [--json] [--svg FILE]
        the first N (default 3) training samples as the model sees them (after the chat template
        and truncation to data.max_seq_len), trained tokens highlighted and, with --tokens, every
        token boundary visible; then the set's statistics per split (records, kept, dropped,
        truncated, tokens, label tokens and fraction, sequence lengths and their histogram), per
        source where there are several. --json prints the same as one JSON document on stdout
        (`jobs.data.preview.data_preview`); --svg also saves what is printed as an SVG picture.

    rayft data prepare SPEC [k=v ...] [--address GCS_ADDRESS] [--num-cpus N]
        builds the job's tokenized cache entry ahead of the job, tokenizing on the Ray cluster's
        CPUs with Ray Data (`jobs.data.prepare`): the same files, byte for byte, at the same path as
        the job's own build, so `rayft run` then tokenizes nothing. Without --address (and no
        $RAY_ADDRESS) a local Ray with N logical CPUs (default: this machine's cores). An entry
        that exists is left alone (exit 0).

preview reads the spec, the tokenizer and the data; writes nothing (no cache entry: the document
comes from the cache's own tokenization run in memory), needs no Ray. Every user mistake is a
`jobs.errors.SpecError` (or a usage error): one line, exit code 2 (`orchestrator.cli.main`); so is
an --address where no cluster answers; a failure on the cluster is one line, exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

from jobs.errors import SpecError, error_line, visible

from . import Parser

LABEL_STYLES = ("bold green on #143214", "bold green on #24502a")  # trained tokens (alternating: --tokens)
CONTEXT_STYLES = ("grey62", "grey62 on #2a2a2a")  # tokens the loss is not computed on
REJECTED_STYLES = ("bold red on #3a1616", "bold red on #5a2424")  # a pair's rejected response
SPECIAL = "italic"
PLAIN_MARKS = ("⟦", "⟧")  # around trained spans when the output has no colours (a pipe, NO_COLOR)
BAR_WIDTH = 40


def register(sub) -> None:
    data = sub.add_parser("data", help="the job's data: preview what will be trained, tokenize it on the cluster")
    dsub = data.add_subparsers(dest="data_cmd", required=True, parser_class=Parser)
    pv = dsub.add_parser(
        "preview",
        help="the first training samples as the model sees them (trained tokens highlighted) and the set's statistics",
    )
    pv.add_argument("spec", help="job spec YAML")
    pv.add_argument("overrides", nargs="*", metavar="section.field=value")
    pv.add_argument("-n", type=_positive_int, default=3, metavar="N", help="samples to show (default 3)")
    pv.add_argument("--tokens", action="store_true", help="show every token boundary (alternating backgrounds)")
    pv.add_argument("--json", action="store_true", help="one JSON document on stdout, for scripts")
    pv.add_argument("--svg", metavar="FILE", help="also save the printed preview as an SVG picture")
    pv.set_defaults(fn=cmd_preview)
    pr = dsub.add_parser(
        "prepare",
        help="build the job's tokenized cache ahead of the job, tokenizing on the Ray cluster's CPUs (Ray Data)",
    )
    pr.add_argument("spec", help="job spec YAML")
    pr.add_argument("overrides", nargs="*", metavar="section.field=value")
    pr.add_argument(
        "--address",
        metavar="GCS_ADDRESS",
        help="the Ray cluster to tokenize on, as `ray.init` takes it (HOST:6379 or ray://HOST:10001; "
        "default: $RAY_ADDRESS, else a local Ray on this machine's cores)",
    )
    pr.add_argument(
        "--num-cpus",
        type=_positive_int,
        metavar="N",
        help="logical CPUs of the local Ray (default: this machine's cores)",
    )
    pr.set_defaults(fn=cmd_prepare)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {n}")
    return n


def cmd_preview(args) -> int:
    from rich.console import Console

    from jobs.data.remote_data import localize
    from jobs.model.loading import load_tokenizer
    from jobs.objectives import Objective
    from jobs.spec import load_spec

    spec = localize(load_spec(args.spec, args.overrides))  # data in a bucket: read from its local copy
    doc = Objective.of(spec).preview(spec, load_tokenizer(spec), args.n)
    if args.svg is not None:  # first: a path that cannot be written is refused before anything is printed
        _save_svg(doc, args)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_preview(Console(), doc, args.tokens)
    return 0


def cmd_prepare(args) -> int:
    import ray

    from jobs.data.prepare import prepare
    from jobs.data.remote_data import localize
    from jobs.model.loading import load_tokenizer
    from jobs.run.outputs import check_cache_place
    from jobs.spec import load_spec

    if args.num_cpus and args.address:
        raise SpecError("--num-cpus sizes a local Ray; a cluster at --address has its own CPUs")
    spec = localize(load_spec(args.spec, args.overrides))
    check_cache_place(spec)  # as `rayft run`: before Ray starts, nothing written outside rayft's places
    started = not ray.is_initialized()
    try:
        reports = prepare(spec, load_tokenizer(spec), args.address, args.num_cpus, say=print)
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    for r in reports:
        print(f"{'prepared' if r['built'] else 'already prepared, left as it is'}: {r['path']}")
    return 0


def _save_svg(doc: dict, args) -> None:
    """What is printed, in colour, 100 columns wide, as an SVG picture (rich's export), written
    the way rayft writes every file: to a place rayft may write (`svg_target`), beside it first,
    then renamed over it, so a failure leaves the old file (or none) and never half a picture."""
    from rich.console import Console

    target = svg_target(args.svg)
    recorder = Console(record=True, file=io.StringIO(), width=100, force_terminal=True, color_system="truecolor")
    _print_preview(recorder, doc, args.tokens)
    svg = recorder.export_svg(title=visible(f"rayft data preview {args.spec} -n {args.n}"))
    try:
        with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}.", delete=False) as f:
            f.write(svg)
        os.replace(f.name, target)
    except OSError as e:
        with contextlib.suppress(NameError, OSError):
            os.unlink(f.name)
        raise SpecError(f"--svg: {error_line(str(target))}: cannot be written ({e.strerror or e})") from None


def svg_target(path: str) -> Path:
    """The file `--svg` may write, or one line saying why not: a file name (not ''), in a place
    rayft may write (`jobs.run.outputs.place_problem`), a new file or a regular one (never through a
    symbolic link, never a FIFO, device or directory), in a writable directory."""
    from jobs.run.outputs import place_problem, writable_problem

    if not path.strip():
        raise SpecError("--svg: needs a file name (got '')")
    p = Path(path)
    why = place_problem(p)
    if why is None and p.is_symlink():
        why = "is a symbolic link: rayft does not write through links; name the file itself"
    elif why is None and os.path.lexists(p) and not p.is_file():
        why = "exists and is not a regular file (a directory, FIFO or device)"
    elif why is None:
        why = writable_problem(p.parent)
    if why:
        raise SpecError(f"--svg: {error_line(path)}: {why}")
    return p


# ---- printing -----------------------------------------------------------------------------------


def _print_preview(con, doc: dict, boundaries: bool) -> None:
    from rich.markup import escape

    con.print(
        f"[bold]{escape(visible(doc['name']))}[/]: {escape(visible(doc['model']))}, objective {doc['objective']}, "
        f"data.max_seq_len {doc['max_seq_len']}" + _budget(doc),
        soft_wrap=True,
        highlight=False,
    )
    for src in doc["sources"]:
        line = visible(f"  {src['name']}: {', '.join(src['paths'])}")
        con.print(line, soft_wrap=True, markup=False, highlight=False)
    con.print(_legend(con, doc["kind"]))
    panel = _prompt_panel if doc["kind"] == "prompts" else _sample_panel
    for sample in doc["samples"]:
        con.print(panel(con, sample, boundaries))
    if not doc["samples"]:
        con.print("[yellow]no training sample is kept[/]")
    _print_stats(con, doc)


def _budget(doc: dict) -> str:
    """Online RL: the prompt length the run keeps (a longer prompt is dropped, never cut)."""
    if "prompt_budget" not in doc:
        return ""
    return f", prompts of at most {doc['prompt_budget']} tokens (the rest is the completion's)"


def _legend(con, kind: str):
    from rich.text import Text

    if kind == "prompts":
        text = "prompt: completions are sampled from it; the loss is on the completions"
        return Text("  ").append_text(_styled(con, [{"text": text, "label": False, "special": False}], False))
    t = Text("  ")
    what = "the responses (chosen, rejected): loss on these" if kind == "pairs" else "trained: loss on these"
    t.append_text(_styled(con, [{"text": what, "label": True, "special": False}], False))
    t.append("   ")
    t.append_text(_styled(con, [{"text": "context: no loss", "label": False, "special": False}], False))
    return t


def _sample_panel(con, sample: dict, boundaries: bool):
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    cut = ", truncated" if sample["truncated"] else ""
    title = (
        f"train sample {sample['example']} ({sample['source']} record {sample['record']}{cut}): "
        f"{sample['n_tokens']} tokens, {sample['n_labels']} trained"
    )
    if "tokens" in sample:
        body = _styled(con, sample["tokens"], boundaries)
    else:
        parts = []
        for name, styles in (("prompt", LABEL_STYLES), ("chosen", LABEL_STYLES), ("rejected", REJECTED_STYLES)):
            parts.append(f"[bold]{name}[/]")
            parts.append(_styled(con, sample[name]["tokens"], boundaries, styles))
        body = Group(*parts)
    return Panel(body, title=Text(visible(title)), title_align="left")


def _prompt_panel(con, sample: dict, boundaries: bool):
    """An online-RL prompt: its tokens as generation starts from them, then the columns the reward
    functions receive beside it."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    title = f"train prompt {sample['example']} ({sample['where']}): {sample['n_tokens']} tokens"
    columns = Text(visible("reward columns: " + (json.dumps(sample["columns"]) if sample["columns"] else "none")))
    body = Group(_styled(con, sample["tokens"], boundaries), columns)
    return Panel(body, title=Text(visible(title)), title_align="left")


def _styled(con, tokens: list[dict], boundaries: bool, label_styles: tuple[str, str] = LABEL_STYLES):
    """The tokens' texts as one rich Text: trained tokens in `label_styles`, the others grey; with
    `boundaries`, the background alternates per token and newlines and tabs show as ↵ and →.
    Without colours (no terminal), trained runs are bracketed with PLAIN_MARKS and, with
    `boundaries`, tokens are separated by '|'."""
    from rich.text import Text

    colour = con.color_system is not None
    runs: list[tuple[str, str]] = []  # (text, style), neighbours of one style joined: one span each
    in_label = False
    for k, tok in enumerate(tokens):
        text = visible(tok["text"], keep="\n\t")  # the data's own escape sequences are shown, not run
        if boundaries:
            text = text.replace("\n", "↵\n").replace("\t", "→")
        if colour:
            styles = label_styles if tok["label"] else CONTEXT_STYLES
            style = styles[k % 2 if boundaries else 0] + (f" {SPECIAL}" if tok["special"] else "")
        else:
            style = ""
            if tok["label"] != in_label:
                text, in_label = (PLAIN_MARKS[0] if tok["label"] else PLAIN_MARKS[1]) + text, tok["label"]
            if boundaries and k < len(tokens) - 1:
                text += "|"
        if runs and runs[-1][1] == style:
            runs[-1] = (runs[-1][0] + text, style)
        else:
            runs.append((text, style))
    if in_label:
        runs.append((PLAIN_MARKS[1], ""))
    return Text.assemble(*runs)


def _print_stats(con, doc: dict) -> None:
    from rich.markup import escape

    scopes = [("all sources" if len(doc["sources"]) > 1 else doc["sources"][0]["name"], doc)]
    if len(doc["sources"]) > 1:
        scopes += [(src["name"], src) for src in doc["sources"]]
    for name, scope in scopes:
        con.print(_stats_table(name, scope, doc["kind"]))
        length = "prompt length" if doc["kind"] == "prompts" else "sequence length"
        con.print(
            f"[bold]{length}[/] (tokens, of data.max_seq_len {doc['max_seq_len']}), {escape(name)}, train",
            highlight=False,
        )
        con.print(_histogram(scope["train"]["histogram"]))


def _stats_table(name: str, scope: dict, kind: str):
    from rich.table import Table

    splits = [s for s in ("train", "eval") if scope[s]["records"]]
    t = Table(title=f"statistics: {name}", title_justify="left")
    t.add_column("")
    for s in splits:
        t.add_column(s, justify="right")
    for label, cell in _stat_rows(kind):
        t.add_row(label, *(cell(scope[s]) for s in splits))
    return t


def _stat_rows(kind: str) -> list:
    if kind == "prompts":  # nothing is truncated and no prompt token is a label
        return [
            ("records", lambda st: str(st["records"])),
            ("kept (prompts)", lambda st: str(st["kept"])),
            ("dropped", lambda st: _dropped(st)),
            ("prompt tokens", lambda st: str(st["tokens"])),
            ("prompt length min / mean / max", _lengths),
        ]
    unit = "pairs" if kind == "pairs" else "samples"
    rows = [
        ("records", lambda st: str(st["records"])),
        (f"kept ({unit})", lambda st: str(st["kept"])),
        ("dropped", lambda st: _dropped(st)),
        ("truncated (kept)", lambda st: str(st["truncated"])),
        ("tokens", lambda st: str(st["tokens"])),
        ("label tokens", lambda st: str(st["label_tokens"])),
        ("label fraction", lambda st: "-" if st["label_fraction"] is None else f"{st['label_fraction']:.1%}"),
        ("sequence length min / mean / max", _lengths),
    ]
    if kind == "pairs":
        rows.append(
            ("prompt / chosen / rejected tokens", lambda st: " / ".join(str(v) for v in st["field_tokens"].values()))
        )
    return rows


def _dropped(st: dict) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in st["dropped_by_reason"].items() if v)
    return f"{st['dropped']} ({reasons})" if reasons else str(st["dropped"])


def _lengths(st: dict) -> str:
    n = st["seq_len"]
    return "-" if n["mean"] is None else f"{n['min']} / {n['mean']:.1f} / {n['max']}"


def _histogram(bins: list[dict]):
    from rich.table import Table

    t = Table(box=None, show_header=False, pad_edge=False)
    t.add_column(justify="right")
    t.add_column()
    t.add_column(justify="right")
    top = max((b["count"] for b in bins), default=0)
    for b in bins:
        t.add_row(f"{b['lo']}-{b['hi']}", f"[cyan]{_bar(b['count'], top)}[/]", str(b["count"]))
    return t


def _bar(count: int, top: int) -> str:
    """A bar of `count` against `top` in eighths of a character, at most BAR_WIDTH characters."""
    if not top:
        return ""
    eighths = round(8 * BAR_WIDTH * count / top)
    return "█" * (eighths // 8) + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[eighths % 8]
