"""`prepare --engine datatrove --executor ray` on a Ray cluster made as a cluster is made: a head node and a worker
node, each started by `ray start` (two raylets on this machine, the worker joining at the head's address), each in a
session of its own so that killing one node kills every process of it. The job runs the quality filters of
test_filters' planted corpus over two labelled sources with exact dedup, 2 tasks per stage, one on each node.

One job proves both halves of the Ray claim, to keep CI short: the worker node is SIGKILLed, every process of it,
while it runs a task; datatrove submits the lost task again (on the head) and the job ends whole, with the
in-process engine's counts per filter and per source and its documents kept. What only a real cluster shows (a
shared file system's caching, the network) is not tested here (docs/data_at_scale.md).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from data_pipeline.prepare import build_dataset
from data_pipeline.scale import Layout
from tests.conftest import REPO
from tests.data_pipeline.test_filters import TOKENIZER, filters_override
from tests.data_pipeline.test_scale import kept_by_job
from tests.helpers.planted_corpus import write_corpus
from training.config.recipe import load_recipe
from training.parallel.launch import free_port

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
RUNNING_TASK = "ray::RankWorker.run_for_rank"  # the title of an actor process while it runs a datatrove task


class Node:
    """One `ray start ... --block`, in a session of its own: kill() ends every process of the node."""

    def __init__(self, options: list[str], log: Path, env: dict):
        with log.open("w") as out:
            self.process = subprocess.Popen([RAY, "start", "--block", "--num-cpus=1", "--object-store-memory=80000000",
                                             *options], env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.log = log

    def processes(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["pid", "status"]):
            try:
                if os.getsid(process.pid) == self.process.pid and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except (ProcessLookupError, psutil.Error):
                pass
        return found

    def running_task(self) -> bool:
        for process in self.processes():
            try:
                if process.cmdline()[:1] and process.cmdline()[0].startswith(RUNNING_TASK):
                    return True
            except psutil.Error:
                pass
        return False

    def kill(self) -> None:
        for process in self.processes():
            try:
                process.kill()
            except psutil.Error:
                pass
        self.process.wait(30)


def wait_until(ready, what: str, nodes: list[Node], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for node in nodes:
            assert node.process.poll() is None, node.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path):
    """A head and a worker node of 1 CPU each; their sessions' files in a folder of the test's under /tmp (a session's
    socket paths must stay within 107 bytes), their TMPDIR tmp_path/tmp."""
    port, temporary, sessions = free_port(), tmp_path / "tmp", Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    temporary.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = dict(env, RAY_USAGE_STATS_ENABLED="0", TMPDIR=str(temporary),  # the job ships its code
               RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")  # a lost node seen in 3 s
    head = Node(["--head", f"--port={port}", f"--temp-dir={sessions}", "--include-dashboard=false"],
                tmp_path / "head.log", env)
    nodes = [head]
    try:
        status = [RAY, "status", f"--address=127.0.0.1:{port}"]
        wait_until(lambda: subprocess.run(status, env=env, capture_output=True).returncode == 0, "the head", nodes)
        nodes.append(Node([f"--address=127.0.0.1:{port}"], tmp_path / "worker.log", env))
        wait_until(lambda: subprocess.run(status, env=env, capture_output=True, text=True).stdout.count(" node_") == 2,
                   "the worker to join", nodes)
        yield {"address": f"127.0.0.1:{port}", "head": head, "worker": nodes[1], "tmp": temporary}
    finally:
        for node in nodes:
            node.kill()
        shutil.rmtree(sessions)
        assert not any(node.processes() for node in nodes)


def test_a_job_whose_worker_node_is_killed_finishes_with_the_in_process_counts(cluster, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus / "all.jsonl")
    halves = [corpus / "first.jsonl", corpus / "second.jsonl"]
    lines = (corpus / "all.jsonl").read_text().splitlines(keepends=True)
    for part, path in zip((lines[::2], lines[1::2]), halves):
        path.write_text("".join(part))
    (corpus / "all.jsonl").unlink()
    overrides = [f"data.sources=[{{path: '{halves[0]}', label: first}}, {{path: '{halves[1]}', label: second}}]",
                 filters_override("length", "regex", "gopher_repetition", "c4", "fineweb_quality",
                                  length={"min_words": 5})]
    output = tmp_path / "prepared"
    command = [sys.executable, "-m", "data_pipeline", "prepare", "--recipe", "tiny_llama", "--output", str(output),
               "--engine", "datatrove", "--executor", "ray", "--tasks", "2", *overrides]
    log = tmp_path / "job.log"
    with log.open("w") as console:
        job = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, RAY_ADDRESS=cluster["address"],
                                                           RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1"),
                               stdout=console, stderr=subprocess.STDOUT)
        worker = cluster["worker"]
        wait_until(lambda: worker.running_task() or job.poll() is not None, "a task on the worker node", [worker])
        worker.kill()
        try:
            job.wait(timeout=240)
        except subprocess.TimeoutExpired:
            job.kill()
            pytest.fail(log.read_text()[-5000:])
    out = log.read_text()
    assert job.returncode == 0, out[-5000:]
    assert "failed with RayActorError" in out or "retriable error" in out, out[-5000:]  # the lost task, run again

    config = load_recipe("tiny_llama", overrides).data
    _, expected, _ = build_dataset(config, TOKENIZER)
    got = json.loads((output / "stats.json").read_text())
    assert got["filters"] == expected["filters"]
    assert sum(f["documents_removed"] > 0 for f in got["filters"]) >= 4
    for key in ("documents_in", "exact_duplicates_removed", "documents_out", "tokens_in"):
        assert got[key] == expected[key], key
    for ours, theirs in zip(got["sources"], expected["sources"], strict=True):
        assert {k: ours[k] for k in ("name", "documents_in", "documents_kept")} == \
            {k: theirs[k] for k in ("name", "documents_in", "documents_kept")}
    work = output.with_name("prepared.datatrove")
    kept = kept_by_job(config, work, 2)
    assert len(kept) == got["documents_out"]  # the duplicates' lists the job wrote, as its counts say

    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "head.log", "job.log", "prepared",
                                                          "prepared.datatrove", "tmp", "worker.log"]
    assert not list(cluster["tmp"].glob("ray_logs*"))  # the tasks' logs stayed in the job's folder
    assert len(list(Path(Layout(work).logs("rows"), "logs").glob("task_*.log"))) == 2
