"""Two nodes on this machine, launched as a cluster launches them: DeepSpeed's own multi-node launcher from a hostfile
of two addresses (127.0.0.1 and 127.0.0.2), once per node in its `--no_ssh --node_rank N` mode (pdsh needs ssh
servers, which this machine lacks). Each node runs in a mount namespace of its own (unshare), where its own folder
is mounted at one path: a node-local disk, at the same path on every node, holding data.cache_dir. The ranks of the
two nodes meet over gloo at MASTER_ADDR, as on a cluster; what only a cluster shows (the network's speed, a GPU
failing) is not tested here (docs/launching.md).

Proven: 2 nodes x 1 and x 2 ranks train the losses of 1 node x 2 and x 4 ranks (within 1e-6; fp32, the same
arithmetic); each node's local rank 0 prepares the data once, into its own disk; an output folder that the second
node does not see is refused, naming that node, before training. A node lost (every process of it SIGKILLed in the
middle of a step, or in the middle of a checkpoint save, or SIGSTOPped) ends the other node's ranks within a stated
time (KILLED_WITHIN_S, STOPPED_WITHIN_S) with one error that names the lost node and the last complete checkpoint, and
exit code 4; no process of the surviving node is left; `latest` names a complete checkpoint; the run resumes on both
nodes, and on one node alone (another world size: a universal checkpoint), on the uninterrupted curve.
"""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, SMALL_MODEL, TRAIN_ENV, deepspeed_ops_built, left_in_session, run_train
from training.parallel.failure import LOST_AFTER_S, LOST_CODE
from training.parallel.launch import free_port, launcher_command
from training.state.checkpoint import latest_tag

pytestmark = pytest.mark.slow

PROBES = "tests/helpers/train_with_probes.py"
STEPS = 8
COMMON = ["--recipe", "tiny_llama", SMALL_MODEL, f"training.max_steps={STEPS}", "checkpointing.every_steps=2",
          "logging.every_steps=1", "training.schedule=constant", "training.warmup_steps=0",
          "training.micro_batch_size=2"]  # 2 x 4 ranks x 2 accumulation: the recipe's 16 rows
KILLED_WITHIN_S = 30.0  # from the kill of a node to the end of the other node's launcher
STOPPED_WITHIN_S = LOST_AFTER_S + 30.0  # from the SIGSTOP of a node to the end of the other node's launcher


def losses(out: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in map(json.loads, (out / "metrics.jsonl").open())
            if "loss" in record}


class Nodes:
    """One launch of `count` nodes of `ranks` ranks: each node's `deepspeed --hostfile ... --no_ssh --node_rank N`,
    in a session of its own (to kill or stop every process of a node), with its console log and its local disk
    (`local(n)`, mounted at `folder/local` for its processes). `unseen`: a folder node 1 sees empty (its own copy)."""

    def __init__(self, folder: Path, count: int, ranks: int, args: list[str], script: str = "train.py",
                 unseen: Path | None = None):
        deepspeed_ops_built()
        self.folder, self.mount = folder, folder / "local"
        self.mount.mkdir(parents=True, exist_ok=True)
        hostfile = folder / "hostfile"
        hostfile.write_text("".join(f"127.0.0.{n + 1} slots={ranks}\n" for n in range(count)))
        launcher, port = launcher_command(1, script, [])[0], free_port()
        self.logs, self.processes = [folder / f"node{n}.log" for n in range(count)], []
        for n in range(count):
            mounts = [(self.local(n), self.mount)]
            if unseen and n == 1:
                mounts.append((self.local(n) / "unseen", unseen))
            for own, at in mounts:
                own.mkdir(parents=True, exist_ok=True)
                at.mkdir(parents=True, exist_ok=True)
            binds = " && ".join(f"mount --bind {own} {at}" for own, at in mounts)
            command = [launcher, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(n), "--master_addr",
                       "127.0.0.1", "--master_port", str(port), script, *args]
            with self.logs[n].open("w") as log:
                self.processes.append(subprocess.Popen(
                    ["unshare", "--mount", "--user", "--map-root-user", "sh", "-c", f'{binds} && exec "$@"', "sh",
                     *command], cwd=REPO, env=TRAIN_ENV, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))

    def local(self, node: int) -> Path:
        return self.folder / f"disk{node}"

    def wait(self, timeout: float = 300) -> list[int]:
        return [process.wait(timeout) for process in self.processes]

    def output(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def signal(self, node: int, signum: int) -> None:
        os.killpg(self.processes[node].pid, signum)

    def left(self, node: int) -> list[psutil.Process]:
        """The processes of the node's session still alive, after up to 10 s."""
        return left_in_session(self.processes[node].pid)


def wait_for(path: Path, nodes: Nodes, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.processes), \
            nodes.output(0)[-3000:] + nodes.output(1)[-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted curve: 1 node x 2 ranks (warm ranks: the same computation as a launch)."""
    out = tmp_path_factory.mktemp("reference")
    result = run_train(["--output-dir", str(out), *COMMON, f"data.cache_dir={out / 'cache'}"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out)


def lose_node(tmp_path: Path, where: str, step: int, signum: int, latest: str) -> tuple[Nodes, Path, float]:
    """2 nodes x 1 rank whose node 1 is held in `where` (step, save) of `step`, then, once `latest` names the save
    before (saves are written in the background), sent `signum`: the launch, its output folder and the seconds from
    the signal to the end of node 0's launcher."""
    out, marker = tmp_path / "out", tmp_path / "held"
    nodes = Nodes(tmp_path, 2, 1, [f"--hold-in-{where}", f"{step}:1:{marker}", "--output-dir", str(out), *COMMON,
                                   f"data.cache_dir={tmp_path / 'local' / 'cache'}"], script=PROBES)
    wait_for(marker, nodes)
    deadline = time.monotonic() + 60
    while latest_tag(out / "checkpoints") != latest:
        assert time.monotonic() < deadline, latest_tag(out / "checkpoints")
        time.sleep(0.1)
    time.sleep(1.0)  # rank 0 is waiting for rank 1 in a collective
    sent = time.monotonic()
    nodes.signal(1, signum)
    code = nodes.processes[0].wait(STOPPED_WITHIN_S + 60)
    seconds = time.monotonic() - sent
    assert code == LOST_CODE, nodes.output(0)[-3000:]
    return nodes, out, seconds


def assert_one_lost_node_error(nodes: Nodes, out: Path, tag: str) -> None:
    errors = re.findall(r"error: .*", nodes.output(0))  # a progress bar may precede it on its line
    assert len(errors) == 1, nodes.output(0)[-3000:]
    assert re.match(r"error: lost node 1 \(.+\), rank\(s\) 1: no heartbeat for \d+ s", errors[0]), errors[0]
    assert f"The last complete checkpoint is {out / 'checkpoints' / tag}: continue with --resume" in errors[0]
    assert "Traceback" not in nodes.output(0)
    assert (out / "checkpoints" / "latest").read_text() == tag
    assert (out / "checkpoints" / tag / "run_state.json").is_file()  # written last: the tag is complete
    assert not nodes.left(0)


def test_two_nodes_train_the_losses_of_one_and_prepare_the_data_once_per_node(tmp_path):
    """2 nodes x 2 ranks against 1 node x 4 (warm ranks), 4 steps; the data is prepared on each node's disk, by its
    local rank 0 only (one save of the prepared rows in each node's log). 2 nodes x 1 rank against 1 x 2: the first
    steps of test_a_node_killed_in_a_step_ends_the_run_and_it_resumes_on_one_node (one launch for both)."""
    args = [*COMMON, "training.max_steps=4", "checkpointing.every_steps=null"]
    single = tmp_path / "single"
    result = run_train(["--output-dir", str(single), *args, f"data.cache_dir={single / 'cache'}"], ranks=4)
    assert result.returncode == 0, result.stderr[-3000:]
    nodes = Nodes(tmp_path, 2, 2, ["--output-dir", str(tmp_path / "out"), *args,
                                   f"data.cache_dir={tmp_path / 'local' / 'cache'}"])
    assert nodes.wait() == [0, 0], nodes.output(0)[-3000:] + nodes.output(1)[-3000:]
    two, one = losses(tmp_path / "out"), losses(single)
    assert two.keys() == one.keys() == {1, 2, 3, 4}
    assert max(abs(two[step] - one[step]) for step in one) <= 1e-6, (two, one)
    for node in range(2):
        assert len(list((nodes.local(node) / "cache").glob("*/stats.json"))) == 1
        # prepare_dataset builds and saves an entry only where none is cached: one save per node, on 2 ranks too
        assert len(re.findall(r"Saving the dataset \(0/", nodes.output(node))) == 1, nodes.output(node)[-3000:]
    assert not (tmp_path / "local" / "cache").exists()  # the mount point itself was never written


def test_an_output_folder_the_second_node_cannot_see_is_refused_naming_it(tmp_path):
    shared = tmp_path / "shared"
    nodes = Nodes(tmp_path, 2, 1, ["--output-dir", str(shared / "out"), *COMMON,
                                   f"data.cache_dir={tmp_path / 'local' / 'cache'}"], unseen=shared)
    codes = nodes.wait()
    output = nodes.output(0) + nodes.output(1)
    assert codes == [2, 2], output[-3000:]
    assert output.count("is not on a file system every node sees") == 1, output[-3000:]
    assert re.search(r"node 1 \(.+\) cannot read the file rank 0 wrote there", output)
    assert "step 1/" not in output and not (shared / "out" / "metrics.jsonl").exists()


def test_a_node_killed_in_a_step_ends_the_run_and_it_resumes_on_one_node(tmp_path, reference):
    """Node 1 SIGKILLed in step 5 (latest: global_step4); the run resumes on 1 node x 1 rank (another world size: a
    universal checkpoint) and trains steps 5 to 8 on the curve. Its steps 1-4 (2 nodes x 1 rank) are the reference's
    (1 node x 2 ranks) within 1e-6: the losses of one node, on two."""
    nodes, out, seconds = lose_node(tmp_path, "step", 5, signal.SIGKILL, "global_step4")
    assert seconds < KILLED_WITHIN_S
    assert_one_lost_node_error(nodes, out, "global_step4")
    before = losses(out)
    assert max(abs(before[step] - reference[step]) for step in range(1, 5)) <= 1e-6
    result = run_train(["--output-dir", str(out), "--resume", *COMMON, f"data.cache_dir={tmp_path / 'cache1'}"],
                       ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = losses(out)
    assert max(abs(resumed[step] - reference[step]) / reference[step] for step in range(5, STEPS + 1)) <= 1e-5


def test_a_node_killed_in_a_save_leaves_the_last_checkpoint_and_it_resumes_on_both(tmp_path, reference):
    """Node 1 SIGKILLed in step 4's save, once DeepSpeed has written its files: `latest` stays at global_step2, and the
    run resumes on the same 2 nodes from there, on the curve."""
    nodes, out, seconds = lose_node(tmp_path, "save", 4, signal.SIGKILL, "global_step2")
    assert seconds < KILLED_WITHIN_S
    assert_one_lost_node_error(nodes, out, "global_step2")
    resumed = Nodes(tmp_path / "again", 2, 1, ["--output-dir", str(out), "--resume", *COMMON,
                                               f"data.cache_dir={tmp_path / 'again' / 'local' / 'cache'}"])
    assert resumed.wait() == [0, 0], resumed.output(0)[-3000:]
    curve = losses(out)
    assert max(abs(curve[step] - reference[step]) / reference[step] for step in range(3, STEPS + 1)) <= 1e-5


def test_a_node_that_hangs_ends_the_run_by_its_heartbeat(tmp_path):
    """Node 1 SIGSTOPped in step 3: no collective fails (gloo would wait 30 minutes), and rank 0's watch ends the run
    once node 1's heartbeat has stood still for LOST_AFTER_S."""
    nodes, out, seconds = lose_node(tmp_path, "step", 3, signal.SIGSTOP, "global_step2")
    try:
        assert LOST_AFTER_S <= seconds < STOPPED_WITHIN_S
        assert_one_lost_node_error(nodes, out, "global_step2")
        assert f"no heartbeat for {LOST_AFTER_S:.0f} s" in nodes.output(0)
    finally:
        nodes.signal(1, signal.SIGKILL)
    nodes.processes[1].wait(30)
    assert not nodes.left(1)
