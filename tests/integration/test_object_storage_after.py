"""`rayft export`, `rayft eval` and `rayft generate` on a run whose `run.output_dir` is in a bucket,
against the real S3 server (the `s3_server` fixture): they fetch what they need through the run's
storage layer (`jobs.run.remote_run`) on "another machine" (another rayft cache, the run's staging
directory gone), and work as on a local run; a prefix without a finished run is one line, exit 2.

The run: `rayft run SPEC --local` in this process into s3://after/runs/tiny-lora (one worker, 4
steps, tiny-llama: its saved base/ is in the bucket beside the adapter)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from gradtools import DEMO, ROOT
from inproc import rayft_in_process
from safetensors.torch import load as load_safetensors

from tests.integration.test_object_storage import ADAPTER, _env, _one_line_exit_2, _rayft_run

URI, PREFIX = "s3://after/runs/tiny-lora", "after/runs/tiny-lora"


@pytest.fixture(scope="module")
def bucket_run(s3_server, tmp_path_factory):
    """(server, the other machine's rayft cache, a working directory there): the finished run is
    only in the bucket."""
    server, cache = s3_server, tmp_path_factory.mktemp("ran-here")
    server.make_bucket("after")
    p = _rayft_run(server, cache, "s3://after/runs/{name}")
    assert p.returncode == 0, p.stderr[-3000:]
    shutil.rmtree(cache)  # the machine that ran it is gone: its staging directory (and base/) with it
    return server, tmp_path_factory.mktemp("elsewhere"), tmp_path_factory.mktemp("cwd")


def _in(bucket_run, *args: str, cwd: Path | None = None, **changes: str):
    """`rayft *args` on the other machine: its cache, in its working directory (or `cwd`)."""
    server, cache, here = bucket_run
    return rayft_in_process(*args, env=_env(server, cache, **changes), cwd=cwd or here)


def _bucket_bytes(server, key: str) -> bytes:
    with server.filesystem().open_input_stream(key) as f:
        return f.read()


def test_export_merge_from_the_bucket_writes_here_a_model_equal_to_base_plus_the_buckets_adapter(bucket_run):
    from transformers import AutoModelForCausalLM

    from jobs.after.export import load_adapted

    server, cache, cwd = bucket_run
    p = _in(bucket_run, "export", URI, "--merge")
    assert p.returncode == 0, p.stderr[-3000:]
    target = cwd / "tiny-lora-merged"
    assert p.stdout.strip() == str(target)
    fetched = cache / "fetched"
    (run,) = [d for d in fetched.iterdir()]  # one copy, nothing half-made beside it
    adapter = run / "adapter"
    # the fetched adapter is the bucket's, bit for bit, and names the fetched base, not the staging dir that ran it
    assert (adapter / "adapter_model.safetensors").read_bytes() == _bucket_bytes(server, f"{PREFIX}/{ADAPTER}")
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(run / "base")
    assert not [n for n in os.listdir(run) if n.startswith("checkpoints")]  # only what the commands read
    merged = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    adapted, _ = load_adapted(adapter)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        with adapted.disable_adapter():
            base = adapted(input_ids=ids).logits
    assert ((base - want).norm() / want.norm()).item() > 1e-3  # the adapter matters
    assert ((got - want).norm() / want.norm()).item() <= 1e-4


def test_export_of_the_adapter_to_a_local_directory_copies_the_buckets_weights(bucket_run, tmp_path):
    server, _, _ = bucket_run
    p = _in(bucket_run, "export", URI, "--to", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-3000:]
    got = load_safetensors((tmp_path / "out" / "adapter_model.safetensors").read_bytes())
    want = load_safetensors(_bucket_bytes(server, f"{PREFIX}/{ADAPTER}"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_generate_from_the_bucket_answers_as_the_merged_export_does_there_too(bucket_run, tmp_path):
    p = _in(bucket_run, "export", URI, "--merge", "--to", str(tmp_path / "merged"))
    assert p.returncode == 0, p.stderr[-3000:]
    args = ("The capital of France is", "--max-new-tokens", "8")
    from_bucket = _in(bucket_run, "generate", URI, *args)
    from_merged = _in(bucket_run, "generate", str(tmp_path / "merged"), *args)
    assert from_bucket.returncode == 0 and from_merged.returncode == 0, from_bucket.stderr[-3000:]
    assert from_bucket.stdout.strip() and from_bucket.stdout == from_merged.stdout
    server, _, _ = bucket_run
    for f in (tmp_path / "merged").iterdir():  # the merged export itself in a bucket: fetched whole
        with server.filesystem().open_output_stream(f"after/exports/merged/{f.name}") as out:
            out.write(f.read_bytes())
    from_exported = _in(bucket_run, "generate", "s3://after/exports/merged", *args)
    assert from_exported.returncode == 0, from_exported.stderr[-3000:]
    assert from_exported.stdout == from_merged.stdout


def test_eval_of_a_spec_whose_run_is_in_the_bucket_scores_its_adapter_and_writes_eval_json_there(bucket_run):
    server, cache, _ = bucket_run
    p = _in(bucket_run, "eval", DEMO, f"run.output_dir={URI}", "--max-new-tokens", "4", cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    written = json.loads(_bucket_bytes(server, f"{PREFIX}/eval.json"))
    assert written["adapter_dir"].startswith(str(cache / "fetched"))
    assert "adapter_exact_match" in written and written["records"] > 0
    assert ".rayft-lease" not in server.objects(PREFIX)  # taken for the write, given back


def test_a_prefix_with_nothing_there_is_one_line_exit_2(bucket_run):
    for command in (("export", "s3://after/runs/nothing-here"), ("generate", "s3://after/nothing", "hi")):
        p = _in(bucket_run, *command)
        _one_line_exit_2(p, "no run there")


def test_a_run_that_has_not_finished_is_one_line_exit_2_with_nothing_fetched(bucket_run):
    server, cache, _ = bucket_run
    fs = server.filesystem()
    for name in (".rayft-run", "metrics.jsonl"):  # a run killed before its end: no summary, no adapter
        fs.copy_file(f"{PREFIX}/{name}", f"after/runs/killed/{name}")
    before = sorted(os.listdir(cache / "fetched")) if (cache / "fetched").exists() else []
    p = _in(bucket_run, "export", "s3://after/runs/killed", "--merge")
    _one_line_exit_2(p, "no finished run (adapter/adapter_config.json is missing)")
    assert (sorted(os.listdir(cache / "fetched")) if (cache / "fetched").exists() else []) == before


def test_wrong_credentials_are_one_line_exit_2(bucket_run):
    p = _in(bucket_run, "export", URI, AWS_SECRET_ACCESS_KEY="not-the-key-0123456789")
    _one_line_exit_2(p, "the store refused the credentials")
    assert "not-the-key" not in p.stderr + p.stdout


def test_export_to_a_uri_is_refused_in_one_line(bucket_run):
    p = _in(bucket_run, "export", URI, "--to", "s3://after/exports/x")
    _one_line_exit_2(p, "a local directory only")
