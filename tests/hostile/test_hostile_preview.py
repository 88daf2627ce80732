"""`rayft data preview` on data nobody has read: the data's terminal control sequences (screen
clear, window title, hidden text, right-to-left override) are shown as escapes, never written raw
to the terminal, a pipe or the `--svg` picture (which stays well-formed XML); `--svg` writes only
a regular file in a place rayft may write, never through a link, never to a FIFO, never ''."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from inproc import ROOT, rayft_in_process
from runs import write_jsonl

DEMO = str(ROOT / "examples" / "tiny-lora.yaml")
SMALL = ["resources.num_workers=1", "data.max_seq_len=96", "data.eval_path=null"]
HOSTILE = "\x1b[2J\x1b]0;owned\x07 plain \x1b[8mhidden\x1b[0m \u202eevil\u202c \x00\x7f\x9b end"
RAW = ("\x1b", "\x07", "\u202e", "\u202c", "\x00", "\x7f", "\x9b")


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "hostile.jsonl"
    rows = [{"text": f"record {i} {HOSTILE}"} for i in range(4)]
    write_jsonl(path, rows)
    return path


@pytest.mark.parametrize("flags", [[], ["--tokens"]])
def test_control_characters_are_shown_not_run(tmp_path, flags):
    data = _data(tmp_path)
    svg = tmp_path / "p.svg"
    p = rayft_in_process("data", "preview", DEMO, *SMALL, f"data.path={data}", "-n", "2", *flags, "--svg", str(svg))
    assert p.returncode == 0, p.stderr
    for raw in RAW:
        assert raw not in p.stdout and raw not in svg.read_text(), repr(raw)
    assert "\\x1b" in p.stdout  # shown, as an escape
    ET.fromstring(svg.read_text())  # well-formed XML


def test_an_error_line_escapes_a_path_with_control_characters(tmp_path):
    name = "x\x1b]0;t\x07.jsonl"
    p = rayft_in_process("data", "preview", DEMO, f"data.path={tmp_path / 'no' / name}")
    assert p.returncode == 2 and "\x1b" not in p.stderr and "\x07" not in p.stderr and "\\x1b" in p.stderr


def _refused(*args: str) -> str:
    p = rayft_in_process("data", "preview", DEMO, *SMALL, *args)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert not p.stdout  # refused before anything is printed
    return lines[0]


def test_svg_never_writes_through_a_link_a_fifo_a_system_place_or_nowhere(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "link.svg"
    link.symlink_to(target)
    assert "symbolic link" in _refused("--svg", str(link))
    assert target.read_text() == "keep me"
    fifo = tmp_path / "fifo.svg"
    os.mkfifo(fifo)
    assert "not a regular file" in _refused("--svg", str(fifo))  # refused, not a hang
    assert "needs a file name" in _refused("--svg", "")
    assert "system directory" in _refused("--svg", "/usr/lib/rayft-preview.svg")
    assert not Path("/usr/lib/rayft-preview.svg").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["fifo.svg", "link.svg", "precious.txt"]


def test_svg_replaces_an_old_picture_whole(tmp_path):
    svg = tmp_path / "p.svg"
    svg.write_text("old")
    p = rayft_in_process("data", "preview", DEMO, *SMALL, "-n", "1", "--svg", str(svg))
    assert p.returncode == 0 and svg.read_text().lstrip().startswith("<svg")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.svg"]  # no temporary file left
