"""Places rayft writes, judged before anything is written, the same way by every command: the
data cache of `rayft data prepare` (it skipped the rule `rayft run` applies: a cache under
/usr/lib or through a link to /etc was written; a cache that is a FIFO or a file started Ray and
failed 10-27 s later), and an MLflow store (a percent-encoded path passed the system-directory
check that SQLAlchemy then decoded; a store that is a link was followed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from inproc import ROOT, rayft_in_process

DEMO = str(ROOT / "examples" / "tiny-lora.yaml")
SMALL = ["resources.num_workers=1", "run.max_steps=1", "data.eval_path=null"]


def _refused(*args: str, fragment: str) -> float:
    t0 = time.monotonic()
    p = rayft_in_process(*args)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert fragment in lines[0], lines[0]
    return time.monotonic() - t0


def test_data_prepare_judges_its_cache_like_run(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    plain = tmp_path / "file"
    plain.write_text("x")
    link = tmp_path / "etc-link"
    link.symlink_to("/etc")
    for cache, fragment in (
        (fifo, "is not a directory"),
        (plain, "is not a directory"),
        ("/usr/lib/rayft-cache", "system directory"),
        (link / "cache", "system directory"),
    ):
        elapsed = _refused("data", "prepare", DEMO, *SMALL, f"data.cache_dir={cache}", fragment=fragment)
        assert elapsed < 20  # before Ray starts
    assert not Path("/usr/lib/rayft-cache").exists() and not Path("/etc/cache").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["etc-link", "fifo", "file"]


def test_an_mlflow_store_is_judged_on_the_path_its_reader_uses(tmp_path):
    out = tmp_path / "out"
    common = ("run", DEMO, *SMALL, f"run.output_dir={out}", "run.trackers=[mlflow]")
    _refused(*common, "run.mlflow_tracking_uri=sqlite:////usr/lib%2Frayft.db", fragment="system directory")
    target = tmp_path / "elsewhere.db"
    target.write_bytes(b"keep")
    (tmp_path / "link.db").symlink_to(target)
    _refused(*common, f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'link.db'}", fragment="symbolic link")
    assert target.read_bytes() == b"keep" and not out.exists()
    assert not Path("/usr/lib/rayft.db").exists()


def test_a_mixture_weight_is_a_number_not_its_text(tmp_path):
    mix = f"data.mix=[{{path: {ROOT / 'examples' / 'data' / 'tiny.jsonl'}, weight: '0.5'}}]"
    _refused("spec", "check", DEMO, mix, "data.path=[]", fragment="must be a number, not a string")


def test_a_tracking_uri_is_shown_as_given_unless_it_holds_user_info():
    from jobs.run.tracking import shown_uri

    assert shown_uri("sqlite:////data/x.db") == "sqlite:////data/x.db"  # was sqlite://data/x.db
    assert shown_uri("sqlite:///rel/x.db") == "sqlite:///rel/x.db"
    assert shown_uri("http://user:pw@mlflow:5000/x") == "http://mlflow:5000/x"
    assert shown_uri("http://:pw@mlflow") == "http://mlflow"
