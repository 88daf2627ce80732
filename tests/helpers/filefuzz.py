"""Mutations of the files rayft reads back, and the targets they are applied to (a tokenized cache
entry, a checkpoint directory, an adapter directory, a queue database, a precomputed reference
entry, a starting adapter, the `--svg` target's place), each with the reader a command runs on it in-process. Shared by
tests/hostile/test_file_fuzz.py and bench/fuzz_files.py."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "tiny.jsonl"
DEMO = str(ROOT / "examples" / "tiny-lora.yaml")
SMALL = [
    "resources.num_workers=1",
    "data.max_seq_len=64",
    "lora.r=4",
    "lora.alpha=8",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "memory.gradient_checkpointing=false",
    "run.max_steps=1",
    "run.eval_every=0",
    "data.eval_path=null",
    "data.eval_fraction=0.1",
]
KINDS = (
    "truncate",
    "flip",
    "fifo",
    "link-to-sibling",
    "dangling-link",
    "link-to-dev-zero",
    "append",
    "grow-header",
    "delete",
    "directory",
)
HANG_S = 30  # an example still running after this has hung (a FIFO opened, say): it fails


@dataclass(frozen=True)
class Mutation:
    kind: str
    index: int  # which file (modulo the target's file count)
    at: int  # a length, an offset or a sibling (modulo what it picks from)
    data: bytes

    def apply(self, root: Path) -> Path:
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
        path = files[self.index % len(files)]
        body = path.read_bytes()
        if self.kind == "truncate":
            path.write_bytes(body[: self.at % max(len(body), 1)])
        elif self.kind == "flip":
            if body:
                i = self.at % len(body)
                path.write_bytes(body[:i] + bytes([body[i] ^ self.data[0]]) + body[i + 1 :])
        elif self.kind == "append":
            path.write_bytes(body + self.data)
        elif self.kind == "grow-header":  # bytes put in front: every offset the header gives moves
            path.write_bytes(self.data + body)
        else:
            path.unlink()
            if self.kind == "fifo":
                os.mkfifo(path)
            elif self.kind == "link-to-sibling":
                others = [f for f in files if f != path] or [path]
                path.symlink_to(others[self.at % len(others)])
            elif self.kind == "dangling-link":
                path.symlink_to(root / "no-such-file")
            elif self.kind == "link-to-dev-zero":
                path.symlink_to("/dev/zero")
            elif self.kind == "directory":
                path.mkdir()
        return path


mutations = st.builds(
    Mutation,
    kind=st.sampled_from(KINDS),
    index=st.integers(0, 10_000),
    at=st.integers(0, 1 << 30),
    data=st.binary(min_size=1, max_size=64).filter(lambda b: b[0] != 0),
)


@contextlib.contextmanager
def alarm(seconds: int = HANG_S) -> Iterator[None]:
    """TimeoutError in this thread after `seconds` (a blocking open() is interrupted)."""

    def fire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def exit_code(fn: Callable[[], Any]) -> int:
    """What the CLI would exit with: 0, or a RayftError's exit code after checking its one line.
    Any other exception propagates: that is a traceback, the failure a fuzz looks for. Shared
    with tests/hostile/test_fuzz.py."""
    from jobs.errors import RayftError

    try:
        fn()
        return 0
    except RayftError as e:
        msg = str(e)
        assert msg.strip() and len(msg.splitlines()) == 1, f"not one line: {msg!r}"
        return e.exit_code


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def warnings_said() -> Iterator[list[str]]:
    h = Warnings()
    logger = logging.getLogger()
    logger.addHandler(h)
    try:
        yield h.lines
    finally:
        logger.removeHandler(h)


# ---- the targets --------------------------------------------------------------------------------


def _spec(out: Path, cache: Path):
    from jobs.spec import load_spec

    return load_spec(DEMO, [*SMALL, f"data.path={DATA}", f"run.output_dir={out}", f"data.cache_dir={cache}"])


def _arrays(data) -> dict[str, np.ndarray]:
    names = ("ids", "targets", "offsets", "lengths", "label_tokens")
    return {f"{s}.{a}": np.array(getattr(getattr(data, s), a)) for s in ("train", "eval") for a in names}


@contextlib.contextmanager
def _markers(where: str) -> Iterator[None]:
    """The digest markers of `jobs.data.verify` kept under `where` for the call, then put back."""
    import jobs.data.verify as verify_mod

    saved, verify_mod.MARKER_DIR = verify_mod.MARKER_DIR, where
    try:
        yield
    finally:
        verify_mod.MARKER_DIR = saved


class CacheTarget:
    """A tokenized cache entry; reader: the data load of `rayft run` (`load_dataset`). Holds: exit 0
    gives exactly the clean entry's arrays (a bad entry is set aside and rebuilt, with a line
    saying so) or exit 2 in one line."""

    name = "cache"

    def build(self, work: Path) -> None:
        from jobs.data import load_dataset
        from jobs.model.loading import byte_tokenizer

        self.tokenizer = byte_tokenizer()
        with _markers(str(work / "markers-build")):
            data = load_dataset(_spec(work / "out", work / "cache"), self.tokenizer)
        self.entry_name = Path(data.cache_dir).name
        self.clean = _arrays(data)
        self.source = work / "cache"

    def root(self, copy: Path) -> Path:
        return copy / self.entry_name

    def read(self, copy: Path, mutated: bool) -> int:
        from jobs.data import load_dataset

        got: dict = {}
        with _markers(str(copy.parent / "markers")), warnings_said() as said:  # a fresh node: the digest runs
            code = exit_code(
                lambda: got.update(_arrays(load_dataset(_spec(copy.parent / "out", copy), self.tokenizer)))
            )
        if code == 0:
            same = got.keys() == self.clean.keys() and all(np.array_equal(got[k], self.clean[k]) for k in got)
            assert same, f"exit 0 on other tokens than the clean entry's; said {said}"
        return code


class CheckpointTarget:
    """A run directory with two complete checkpoints; reader: what `rayft run` on it does before
    resuming (`resumable`, then `restore`'s loads). Holds: exit 2 in one line, or the checkpoint
    resumed from loads exactly as a clean one (the newest; an older one only after a line saying
    the newer was skipped; none only when no checkpoint directory is left)."""

    name = "checkpoint"

    def build(self, work: Path) -> None:
        import torch

        from jobs.run import checkpoint as ckpt

        self.source = work / "run"
        self.clean: dict[str, Any] = {}
        for step in (1, 2):
            d = self.source / "checkpoints" / ckpt.step_dir_name(step)
            g = torch.Generator().manual_seed(step)
            adapter = {"a.lora_A": torch.randn(4, 8, generator=g), "a.lora_B": torch.randn(8, 4, generator=g)}
            optim = {"state": {"a.lora_A": {"exp_avg": torch.randn(4, 8, generator=g)}}, "param_groups": []}
            state = {"step": step, "tokens_seen": 10 * step, "skipped_steps": 0, "world_size": 1, "resume_key": {}}
            files = {ckpt.ADAPTER_FILE: adapter, ckpt.OPTIMIZER_FILE: optim, ckpt.STATE_FILE: state}
            ckpt.write_rank_files(d, 0, {ckpt.rng_file(0): ckpt.rng_state(), **files})
            self.clean[d.name] = self._load(d)

    def root(self, copy: Path) -> Path:
        return copy / "checkpoints"

    @staticmethod
    def _load(d: Path) -> dict:
        from jobs.run import checkpoint as ckpt

        plain = {n: ckpt.load_plain(d / n) for n in (ckpt.OPTIMIZER_FILE, ckpt.rng_file(0))}
        return {"state": ckpt.load_state(d), "adapter": ckpt.load_adapter(d), **plain}

    def read(self, copy: Path, mutated: bool) -> int:
        from jobs.run import checkpoint as ckpt

        found: list = []

        def resume() -> None:
            d = ckpt.resumable(copy / "checkpoints")
            found.append(d if d is None else (d.name, self._load(d)))

        with warnings_said() as said:
            code = exit_code(resume)
        if code == 0:
            if found[0] is None:
                assert not ckpt.list_checkpoints(copy / "checkpoints"), "checkpoints left, yet a fresh start"
                return 0
            name, got = found[0]
            assert _equal(got, self.clean[name]), f"resumed from {name} with other contents than a clean one"
            newest = ckpt.list_checkpoints(copy / "checkpoints")[-1].name
            assert name == newest or any("skipping checkpoint" in s for s in said), said
        return code


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class AdapterTarget:
    """A trained run's `adapter/` directory; reader: `rayft generate ADAPTER hi --max-new-tokens 2`
    in-process. Holds: exit 0 or exit 2 in one line, never a traceback or a hang. (A PEFT adapter
    directory carries no digest: a flipped byte inside a weight's payload loads as other weights.)"""

    name = "adapter"

    def build(self, work: Path) -> None:
        from jobs.spec import absolutize
        from jobs.train.context import LocalContext
        from jobs.train.loop import train

        run = work / "run"
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            spec = absolutize(_spec(run, work / "cache"))
            train(spec, LocalContext(on_progress=lambda r: None), resume=False)
        finally:
            os.chdir(cwd)
        self.source = run / "adapter"

    def root(self, copy: Path) -> Path:
        return copy

    def read(self, copy: Path, mutated: bool) -> int:
        from inproc import rayft_in_process

        r = rayft_in_process("generate", str(copy), "hi", "--max-new-tokens", "2")
        assert r.returncode in (0, 2), r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        if r.returncode:
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1, r.stderr
        return r.returncode


class QueueTarget:
    """A queue database of three jobs (one failed); readers: `rayft queue status`, `status --json`,
    `retry 3`, in-process. Holds: each exits 0 or 2, a refusal in one line, never a traceback; a
    damaged row is reported by job id and skipped."""

    name = "queue"

    def build(self, work: Path) -> None:
        from inproc import rayft_in_process

        self.source = work / "queue"
        self.source.mkdir()
        db = self.source / "q.db"
        for name in ("one", "two", "three"):
            r = rayft_in_process("queue", "add", DEMO, f"name={name}", "--db", str(db))
            assert r.returncode == 0, r.stderr
        c = sqlite3.connect(db, isolation_level=None)
        c.execute("UPDATE jobs SET state='FAILED' WHERE id=3")
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        c.close()

    def root(self, copy: Path) -> Path:
        return copy

    def read(self, copy: Path, mutated: bool) -> int:
        from inproc import rayft_in_process

        codes = []
        for args in (["status"], ["status", "--json"], ["retry", "3"]):
            r = rayft_in_process("queue", *args, "--db", str(copy / "q.db"))
            assert r.returncode in (0, 2), (args, r.returncode, r.stderr)
            assert "Traceback" not in r.stderr, r.stderr
            if r.returncode:
                lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "skipped" not in ln]
                assert len(lines) == 1, r.stderr
            codes.append(r.returncode)
        return max(codes)


class ReferenceTarget:
    """A precomputed reference entry (`objective.reference: precomputed`); reader: what a DPO run's
    first step does (`precomputed_reference`, one rank, a stand-in engine whose reference forward
    gives the clean values). Holds: exit 0 gives exactly the clean tables (a bad entry is set aside
    and computed again, with a line saying so), never a traceback or a hang."""

    name = "reference"
    pairs = {"train": 12, "eval": 3}

    def build(self, work: Path) -> None:
        g = np.random.default_rng(0)
        self.clean = {split: -g.random((n, 2)) * 100 for split, n in self.pairs.items()}
        self.source = work / "cache"
        with _markers(str(work / "markers-build")):
            self._tables(self.source)
        (entry,) = (p for p in self.source.iterdir() if p.is_dir())
        self.entry_name = entry.name

    def _tables(self, cache: Path) -> dict:
        from types import SimpleNamespace

        from jobs.objectives.reference import precomputed_reference

        data = SimpleNamespace(cache_dir=cache / "entry", **{k: range(n) for k, n in self.pairs.items()})
        job = SimpleNamespace(data=data, precision="fp32")
        ctx = SimpleNamespace(is_main=True, rank=0, world_size=1)
        engine = SimpleNamespace(device="cpu", autocast=contextlib.nullcontext, module=self._forward)
        return precomputed_reference(_spec(cache / "out", cache), ctx, job, engine, _pair_batch)

    def _forward(self, split, idx, reference_only: bool):
        """The reference forward: (chosen..., rejected...) log-probabilities of the pairs `idx`."""
        import torch

        table = torch.from_numpy(self.clean["train" if int(split) == 0 else "eval"])[idx]
        return torch.cat([table[:, 0], table[:, 1]])

    def root(self, copy: Path) -> Path:
        return copy / self.entry_name

    def read(self, copy: Path, mutated: bool) -> int:
        got: dict = {}
        with _markers(str(copy.parent / "markers")), warnings_said() as said:  # a fresh node: the digest runs
            code = exit_code(lambda: got.update(self._tables(copy)))
        if code == 0:
            same = got.keys() == self.clean.keys() and all(np.array_equal(got[k], self.clean[k]) for k in got)
            assert same, f"exit 0 on other reference values than the clean entry's; said {said}"
        return code


def _pair_batch(job, split: str, idx) -> dict:
    import torch

    return {"split": torch.tensor(0 if split == "train" else 1), "idx": torch.as_tensor(idx)}


class StartAdapterTarget:
    """A starting adapter (`model.adapter`) of a LoRA never trained (B drawn off zero); reader: what
    `rayft run` does with it, the driver's checks (`starting_adapter_config`) then the worker's load
    (`add_lora` on the base). Holds: exit 0 or 2 in one line, never a traceback or a hang; exit 0
    means every trainable LoRA weight is the file's tensor of that name (none left at a fresh init)."""

    name = "start"

    def build(self, work: Path) -> None:
        import torch

        from jobs.model.loading import add_lora, load_base_model

        spec = _spec(work / "out", work / "cache")
        model = add_lora(load_base_model(spec, "fp32")[0], spec)
        g = torch.Generator().manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data = torch.randn(p.shape, generator=g)
        self.source = work / "adapter"
        model.save_pretrained(self.source)

    def root(self, copy: Path) -> Path:
        return copy

    def read(self, copy: Path, mutated: bool) -> int:
        loaded: dict = {}
        code = exit_code(lambda: loaded.update(_start_from(copy)))
        if code == 0:
            from safetensors.torch import load_file

            saved = load_file(copy / "adapter_model.safetensors")
            for n, p in loaded.items():
                key = n.replace(".default", "")
                assert key in saved and _equal(saved[key], p), f"exit 0, yet {n} is not the file's tensor"
        return code


def _start_from(adapter: Path) -> dict:
    """The trainable weights of the model `rayft run` trains from `adapter`, after the driver's checks."""
    from jobs.model.loading import add_lora, load_base_model, starting_adapter_config
    from jobs.spec import load_spec

    where = adapter.parent
    spec = load_spec(DEMO, [*SMALL, f"data.path={DATA}", f"run.output_dir={where / 'out'}", f"model.adapter={adapter}"])
    starting_adapter_config(spec)
    model = add_lora(load_base_model(spec, "fp32")[0], spec)
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


class SvgTarget:
    """The place `rayft data preview --svg DIR/p.svg` writes (an old picture `p.svg` beside a
    `precious.txt`); reader: the command's writer (`_save_svg`) with a preview built once. Holds:
    exit 0 or 2 in one line, never a traceback or a hang; exit 0 means `p.svg` is a regular file (not
    a link) holding a well-formed SVG and nothing else in the directory changed (no file written
    through a link, no temporary left); exit 2 means nothing there changed at all."""

    name = "svg"

    def build(self, work: Path) -> None:
        from jobs.data.preview import data_preview
        from jobs.model.loading import load_tokenizer
        from jobs.spec import load_spec

        spec = load_spec(DEMO, [*SMALL, f"data.path={DATA}", f"run.output_dir={work / 'out'}"])
        self.doc = data_preview(spec, load_tokenizer(spec), 2)
        self.source = work / "place"
        self.source.mkdir()
        (self.source / "p.svg").write_text("<svg>an old picture</svg>")
        (self.source / "precious.txt").write_text("not rayft's")

    def root(self, copy: Path) -> Path:
        return copy

    def read(self, copy: Path, mutated: bool) -> int:
        import argparse
        import xml.etree.ElementTree as ET

        from orchestrator.cli.data import _save_svg

        before = _entries(copy)
        args = argparse.Namespace(svg=str(copy / "p.svg"), spec="spec.yaml", n=2, tokens=False)
        code = exit_code(lambda: _save_svg(self.doc, args))
        after = _entries(copy)
        if code != 0:
            assert after == before, f"refused (exit {code}), yet the directory changed"
            return code
        target = copy / "p.svg"
        assert target.is_file() and not target.is_symlink(), "exit 0, yet p.svg is not a regular file"
        ET.fromstring(target.read_text())  # a well-formed picture
        assert {k: v for k, v in after.items() if k != "p.svg"} == {k: v for k, v in before.items() if k != "p.svg"}, (
            "exit 0, yet another file changed (written through a link, or a temporary left)"
        )
        return code


def _entries(place: Path) -> dict[str, tuple]:
    """{name: what it is}: a link's target, a regular file's bytes, else its kind (never opened)."""
    out: dict[str, tuple] = {}
    for p in sorted(place.iterdir()):
        if p.is_symlink():
            out[p.name] = ("link", os.readlink(p))
        elif p.is_file():
            out[p.name] = ("file", p.read_bytes())
        else:
            out[p.name] = ("dir" if p.is_dir() else "other",)
    return out


TARGETS = {
    t.name: t
    for t in (CacheTarget, CheckpointTarget, AdapterTarget, QueueTarget, ReferenceTarget, StartAdapterTarget, SvgTarget)
}


def check(target, mutation: Mutation | None) -> tuple[int, str]:
    """Copy the clean target, apply `mutation`, run its reader under the hang alarm: (exit, file)."""
    with tempfile.TemporaryDirectory(prefix="filefuzz-") as tmp:
        copy = Path(tmp) / "copy"
        shutil.copytree(target.source, copy, symlinks=True)
        hit = "" if mutation is None else mutation.apply(target.root(copy)).name
        with alarm():
            return target.read(copy, mutation is not None), hit
