"""Run a job on Ray Train: an existing cluster (address, or inside `ray job submit`), or an
embedded local Ray started here. Used by `python -m jobs.finetune` and by `rayft run`."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray

from jobs.errors import NodeLost, RunError, peer_gone, unreachable_workers, worker_error, worker_failure_line
from jobs.run import mirror, runlock
from jobs.run.step_record import StepRecord
from jobs.spec import JobSpec

log = logging.getLogger("rayft")


@ray.remote(num_cpus=0)
class ProgressActor:
    """Rank 0 pushes one record per optimizer step; the driver polls. Every rank also says at
    start-up which node it runs on (`placed`), so that a failure can be matched to a lost node
    (`node_lost`). Holds no GPU or CPU."""

    def __init__(self):
        self.records: list[StepRecord] = []
        self.nodes: dict[int, tuple[str, str]] = {}  # world rank -> (node id, node ip), newest start

    def placed(self, rank: int, node_id: str, node_ip: str) -> None:
        self.nodes[rank] = (node_id, node_ip)

    def placement(self) -> dict[int, tuple[str, str]]:
        return dict(self.nodes)

    def put(self, record: StepRecord) -> None:
        self.records.append(record)

    def since(self, n: int) -> list[StepRecord]:
        return self.records[n:]


def train_worker(config: dict) -> None:
    # Runs on every Ray Train worker: a process of its own for this one run.
    from jobs.model.loading import hide_unused_bitsandbytes

    spec = JobSpec.model_validate(config["spec"])
    hide_unused_bitsandbytes(spec.model.quantization)  # before anything imports PEFT
    from jobs.train.loop import train
    from jobs.train.ray_context import RayContext

    # Ray Train logs every report at INFO under a logger its level filter misses; keep the
    # worker console to warnings (rayft's own progress comes through the progress actor).
    logging.getLogger().setLevel(logging.WARNING)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    _report_placement(config.get("relay"))
    token = config.get("run_token")
    train(spec, RayContext(config.get("progress"), spec, token), resume=config["resume"], run_token=token)


def _report_placement(relay) -> None:
    """Tell the driver's relay (a ProgressActor) which node this rank runs on; at every start,
    so after a restart the relay holds the nodes of the workers that run now."""
    if relay is None:
        return
    import ray.train

    try:
        rank = ray.train.get_context().get_world_rank()
        ctx = ray.get_runtime_context()
        ray.get(relay.placed.remote(rank, ctx.get_node_id(), ray.util.get_node_ip_address()), timeout=30)
    except Exception:  # noqa: BLE001 - only a better error line depends on it: never fail a run over it
        log.warning("rayft: could not record this worker's node; a lost node may be reported by Ray's error only")


def reported_placement(relay) -> dict[int, tuple[str, str]] | None:
    """{world rank: (node id, node ip)} the workers reported to `relay`, or None (no relay, or it
    cannot answer: it is pinned to the driver's node, so a lost node does not take it along)."""
    if relay is None:
        return None
    try:
        return ray.get(relay.placement.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - the failure is reported either way, with or without the node
        return None


def init_ray(address: str | None, num_cpus: int, log_to_driver: bool = True) -> None:
    """Connect to `address`, or the cluster of the enclosing Ray job, or start a local one with
    at least `num_cpus` logical CPUs (Ray's own tests oversubscribe a small machine the same way)."""
    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, log_to_driver=log_to_driver, logging_level=logging.WARNING)
        _condense_worker_tracebacks()
        return
    # Pin the GCS address and hand it to every process as RAY_ADDRESS. Ray Train's detached
    # PlacementGroupCleaner asks the state API whether its controller is alive; without
    # RAY_ADDRESS that API resolves the address from /tmp/ray/ray_current_cluster, i.e. the newest
    # `ray start` cluster on the machine -- not this one -- finds no controller, and removes the
    # placement group of a live run. The dashboard stays on: that state API is served by it.
    for attempt in range(GCS_START_TRIES):
        try:
            _start_local(num_cpus, log_to_driver)
            break
        except RuntimeError as e:
            # The port was free when picked and taken before the GCS bound it (another process on
            # the machine starting at the same moment): pick again, a bounded number of times.
            if "Failed to start GCS" not in str(e) or attempt == GCS_START_TRIES - 1:
                raise
            ray.shutdown()
    _condense_worker_tracebacks()


GCS_START_TRIES = 3


class _DefaultTokenNotice(logging.Filter):
    """Drops Ray's notice that a new local cluster uses token authentication (Ray's default since
    2.60, and what rayft's own cluster should use): it was the first line of every `rayft run`,
    before rayft's own. Ray's other authentication warnings (auth disabled, a token missing) pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"


def _start_local(num_cpus: int, log_to_driver: bool) -> None:
    """Start a local cluster on 127.0.0.1 with its GCS on a free port of its own."""
    token_log = logging.getLogger(TOKEN_SETUP_LOGGER)
    if not any(isinstance(f, _DefaultTokenNotice) for f in token_log.filters):
        token_log.addFilter(_DefaultTokenNotice())
    gcs_port = _free_port()
    os.environ["RAY_GCS_SERVER_PORT"] = str(gcs_port)
    try:
        # address="local": never attach to some other `ray start` cluster on this machine.
        ray.init(
            address="local",
            num_cpus=max(num_cpus, os.cpu_count() or 1),
            log_to_driver=log_to_driver,
            logging_level=logging.WARNING,
            _node_ip_address="127.0.0.1",
            dashboard_port=_free_port(),
            runtime_env={"env_vars": {"RAY_ADDRESS": f"127.0.0.1:{gcs_port}"}},
        )
    finally:
        os.environ.pop("RAY_GCS_SERVER_PORT", None)


# Lines of Ray's own that are not about the run and that a user cannot act on, dropped from the
# console (they stay in Ray's log files). Each is matched by all of its parts.
RAY_NOISE = (
    # Ray Train v2 starts its PreemptionWatcher actor with max_restarts=-1 and its arguments in the
    # object store, and the core worker logs that combination at error level every run
    # (ray-project/ray#53727): the watcher works; nothing is wrong.
    ("core_worker.cc", "Actor with class name: 'PreemptionWatcher'", "max_restarts > 0"),
    # After a node is lost, the GCS cannot return the placement group's bundles on that node and
    # says so once its retries end, after rayft's own verdict (which names the lost node).
    ("Failed to remove", "bundle(s) for placement group", "max retry count is reached"),
)


def is_ray_noise(line: str) -> bool:
    return any(all(part in line for part in parts) for parts in RAY_NOISE)


class _TracebackFilter:
    """Ray prints the tracebacks its workers and Train controller log (a crashed peer, a failed
    shutdown after a lost node) on this console, next to rayft's own one-line verdict. Each one is
    cut to the exception line here; the whole traceback stays in Ray's log files on the node.
    Known noise (`RAY_NOISE`) is dropped."""

    def __init__(self, print_batch: Callable[[dict], None]):
        self.print_batch = print_batch
        self.inside: dict = {}  # (pid, stream) -> inside a traceback's frames

    def __call__(self, data: dict) -> None:
        key, kept = (data.get("pid"), data.get("is_err")), []
        for line in data.get("lines") or []:
            if line.strip() == "Traceback (most recent call last):":
                self.inside[key] = True
            elif self.inside.get(key) and line[:1].isspace():
                pass  # a frame or its source line
            elif is_ray_noise(line):
                self.inside[key] = False
            else:
                self.inside[key] = False
                kept.append(line)
        if kept:
            self.print_batch({**data, "lines": kept})


def _condense_worker_tracebacks() -> None:
    """Put `_TracebackFilter` in front of Ray's printer of worker output (when it prints any). The
    dispatcher is Ray's internal API: when it is not there, Ray's output is left as it is."""
    try:
        from ray._private import worker as ray_worker

        dispatcher = ray_worker.global_worker_stdstream_dispatcher
        handler = dict(dispatcher.handlers).get("ray_print_logs")
        if handler is None or isinstance(handler, _TracebackFilter):
            return
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", _TracebackFilter(handler))
    except Exception:  # noqa: BLE001 - cosmetic: never fail a run over console output
        return


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def relay_actor():
    """A relay (ProgressActor) pinned to the calling driver's node: it holds no resources, so Ray
    could put it on any node, and losing that node would end the run whatever `run.max_failures`
    allows (and with it what the workers told it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    # `@ray.remote(num_cpus=0)` makes an ActorClass; Ray's annotations give that form the class back unchanged.
    strategy = NodeAffinitySchedulingStrategy(here, soft=False)
    return ProgressActor.options(scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]


def make_trainer(spec: JobSpec, *, resume: bool = True, progress=None, relay=None, callbacks: list | None = None):
    """The TorchTrainer that runs `spec` (the one setup `run_on_ray` and every Tune trial use):
    `resources.num_workers` workers with `cpus_per_worker` CPUs and one GPU each when `use_gpu`,
    checkpoints in `<output_dir>/checkpoints/step-NNNNNNNN` (Ray Train's storage is the output
    dir, see jobs.run.checkpoint), `run.max_failures` restarts, `run.env` in every worker. Rank 0
    sends its step records to `progress`, every rank its node to `relay` (ProgressActors)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    r = spec.resources
    return TorchTrainer(
        train_worker,
        train_loop_config={
            "spec": spec.to_dict(),
            "progress": progress,
            "relay": relay,
            "resume": resume,
            # the driver's hold on the output dir's lock: rank 0 then knows the holder (jobs.run.runlock)
            "run_token": runlock.held_token(spec.output_path),
        },
        scaling_config=ScalingConfig(
            num_workers=r.num_workers,
            use_gpu=r.use_gpu,
            accelerator_type=r.accelerator_type,
            resources_per_worker={"CPU": r.cpus_per_worker, **({"GPU": 1} if r.use_gpu else {})},
        ),
        # ray.train binds RunConfig to Train V2's class at runtime (these are its fields); its
        # annotations name ray.air's older one, the first of the two conditional imports.
        run_config=RunConfig(  # type: ignore[call-arg]
            name="checkpoints",
            storage_path=str(spec.output_path.resolve()),
            failure_config=FailureConfig(max_failures=spec.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.run.keep_checkpoints),
            logging_config=LoggingConfig(log_level="WARNING"),  # rayft prints its own progress
            worker_runtime_env={"env_vars": dict(spec.run.env)} if spec.run.env else None,
            callbacks=callbacks,
        ),
    )


def run_on_ray(
    spec: JobSpec,
    *,
    address: str | None = None,
    resume: bool = True,
    on_progress: Callable[[StepRecord], None] | None = None,
) -> dict:
    """Train `spec` on Ray; returns summary.json's content. Blocks until the run ends."""
    from jobs.run.outputs import SUMMARY

    # One logical CPU per worker plus one for Ray Train's controller.
    init_ray(address, math.ceil(spec.resources.num_workers * spec.resources.cpus_per_worker) + 1)
    out = spec.output_path.resolve()
    # The relay: rank 0's step records when they are shown, and with several workers where each
    # runs (a failure of the survivors of a lost node names that node: `node_lost`).
    relay = relay_actor() if on_progress or spec.resources.num_workers > 1 else None
    progress = relay if on_progress else None
    trainer = make_trainer(spec, resume=resume, progress=progress, relay=relay)
    result: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
        except Exception as e:  # surfaced below, in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    seen = 0
    while thread.is_alive():
        thread.join(timeout=0.5)
        if progress is not None and on_progress is not None:
            for rec in ray.get(progress.since.remote(seen)):
                seen += 1
                on_progress(rec)
    if progress is not None and on_progress is not None:
        for rec in ray.get(progress.since.remote(seen)):
            on_progress(rec)
    if "error" in result:
        lost = node_lost(result["error"], placement=reported_placement(relay))
        if lost is not None:
            n = spec.run.max_failures
            why = f"after run.max_failures={n} restarts" if n else "run.max_failures=0"
            raise NodeLost(
                f"{lost}; the run stopped ({why}). "
                f"{resume_hint(spec)}"
                + ("" if n else " (with run.max_failures=1 it resumes on its own once the cluster has room again)"),
                lost.node_id,
                lost.node_ip,
            ) from None
        raise worker_error(result["error"]) or failed_run(result["error"], spec) or result["error"]
    if not (out / SUMMARY).is_file() and mirror.store_of(spec) is not None:
        mirror.pull_file(spec, SUMMARY)  # rank 0 ran on another node: its summary is in the store
    return json.loads((out / SUMMARY).read_text())


def failed_run(err: BaseException, spec: JobSpec) -> RunError | None:
    """The one line of a Ray Train failure that is about a training worker (`worker_failure`: its
    process died, it stopped answering, or it raised) and neither a rayft error nor a lost node:
    which rank, what happened, why the run did not restart, and what a rerun resumes from. None
    for a failure that names no worker (Ray's own error is then what there is to show)."""
    what = worker_failure_line(err)
    if what is None:
        return None
    n = spec.run.max_failures
    why = f"after run.max_failures={n} restarts" if n else "run.max_failures=0"
    again = "" if n else " (with run.max_failures=1 Ray Train restarts the workers from the newest checkpoint)"
    return RunError(f"{what}; the run stopped ({why}). {resume_hint(spec)}{again}")


# How long to wait for the cluster to mark a node dead once a worker on it stopped answering. Ray's
# GCS declares a node dead after 5 failed health checks 3 s apart (Ray 2.60's defaults,
# health_check_failure_threshold / _period_ms): about 15 s for a raylet that is gone (each check
# refused at once), up to 5 x (3 + 10) s when the host does not answer (each check times out).
NODE_DEATH_WAIT_S = 70.0


def node_lost(
    err: BaseException,
    wait_s: float = NODE_DEATH_WAIT_S,
    placement: dict[int, tuple[str, str]] | None = None,
    probe: Callable[[list[str]], Callable[[], set[str]]] | None = None,
) -> NodeLost | None:
    """A `NodeLost` naming the node when a Ray Train failure `err` came from losing a node, else None.

    The candidates: the nodes of workers that stopped answering (`unreachable_workers`, Ray
    Train's health check); or, when the failure seen first is a surviving rank's collective
    losing its peer (`peer_gone`) and no health check has failed yet, the nodes the workers
    reported at start-up (`placement`, {world rank: (node id, node ip)}). A candidate is only a
    lost node when Ray marks it dead, so the cluster is asked (for up to `wait_s`): a worker
    process killed on a node that is still up is a different failure (`failed_run`'s line).
    Such a node never gets that verdict, so each candidate is also sent a task pinned to it
    (`probe`, default `node_answers`): once every candidate has run it, no node is lost and the
    wait ends there (a crashed worker's error came `wait_s` late when its node was up)."""
    workers = _candidate_nodes(err, placement)
    if not workers:
        return None
    deadline, answered = time.monotonic() + wait_s, None
    while True:
        try:
            dead = {n["NodeID"]: n for n in ray.nodes() if not n.get("Alive") and n.get("NodeID") in workers}
        except Exception:  # noqa: BLE001 - the cluster cannot say: not provably a lost node
            return None
        if dead:
            return _lost_node(*sorted(dead.items())[0], workers)
        if time.monotonic() >= deadline:
            return None
        answered = answered or (probe or node_answers)(sorted(workers))
        if answered() >= workers.keys():
            return None  # every candidate node ran a task: a worker process died, not a node
        time.sleep(1.0)  # waiting for the cluster's verdict on the node


def _candidate_nodes(
    err: BaseException, placement: dict[int, tuple[str, str]] | None
) -> dict[str, tuple[str, list[int]]]:
    """{node id: (node ip, [world ranks])} that `node_lost` asks the cluster about."""
    workers = unreachable_workers(err)
    if not workers and placement and peer_gone(err):
        for rank, (node_id, ip) in placement.items():
            workers.setdefault(node_id, (ip, []))[1].append(rank)
    return workers


def _lost_node(node_id: str, node: dict, workers: dict[str, tuple[str, list[int]]]) -> NodeLost:
    """The `NodeLost` of a node Ray marked dead (`node`: its row of `ray.nodes()`)."""
    ip, ranks = workers[node_id]
    why = (node.get("DeathReasonMessage") or "").strip().splitlines()
    what = f"training worker rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
    return NodeLost(
        f"lost node {node_id} ({ip or node.get('NodeManagerAddress', '?')}), which held {what}"
        + (f" ({why[0][:200]})" if why else ""),
        node_id,
        ip,
    )


@ray.remote(num_cpus=0)
def _here() -> bool:
    return True


def node_answers(node_ids: list[str]) -> Callable[[], set[str]]:
    """Send each node of `node_ids` a task pinned to it (no CPU asked: it runs beside anything); the
    function returned says which of them have run theirs so far. A node whose task ran is up; a
    lost node's never runs (it fails once Ray marks the node dead)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pinned = lambda node_id: NodeAffinitySchedulingStrategy(node_id, soft=False)  # noqa: E731
    refs = {_here.options(scheduling_strategy=pinned(n)).remote(): n for n in node_ids}

    def answered() -> set[str]:
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return {refs[ref] for ref in done if _ran(ref)}

    return answered


def _ran(ref) -> bool:
    try:
        return bool(ray.get(ref, timeout=0))
    except Exception:  # noqa: BLE001 - a task that failed (its node died) did not run there
        return False


def resume_hint(spec: JobSpec) -> str:
    """What a rerun does with the checkpoints already written, for the line that reports a failure."""
    from jobs.run.checkpoint import newest_complete
    from jobs.run.storage import is_uri

    where = spec.output_location
    if is_uri(where):  # the driver's staging directory may hold none of them: the bucket decides
        return (
            f"Checkpoints written before it are in {where.rstrip('/')}/checkpoints: `rayft run` with "
            f"run.output_dir={where} resumes from the newest that verifies (or starts over if there is none)"
        )
    root = spec.output_path.resolve() / "checkpoints"
    newest = newest_complete(root, warn=False)
    if newest is None:
        return f"No checkpoint was written before it: `rayft run` with run.output_dir={spec.output_path} starts over"
    step = int(Path(newest).name.rsplit("-", 1)[1])
    return (
        f"Checkpoints up to step {step} are kept in {root}: `rayft run` with run.output_dir={spec.output_path} "
        f"resumes from step {step}"
    )
