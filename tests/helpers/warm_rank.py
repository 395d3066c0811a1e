"""The test suite's warm ranks (tests/warm_ranks.py): one process that imports the product once and then forks the
ranks of each run from itself, so that each rank starts as a fresh process of the `deepspeed` launcher would, less
the seconds of imports.

    python tests/helpers/warm_rank.py REPLY_FD

A job is a JSON line on stdin: {"script", "ranks": [{"args", "env", "stdout", "stderr"}, ...]}. For each rank the
process forks a child that sets the rank's `env` (the variables the launcher sets, MASTER_PORT new for each job),
sends its file descriptors 1 and 2 to the rank's files, calls the script's `main(args)` and exits with its code.
The parent writes {"pids": [...]} to REPLY_FD once the ranks are started, then {"rank": i, "code": exit code} as each
one ends. The parent itself never runs a job: it stays as its imports left it, so no run sees what an earlier run
changed (patches, registries, caches, DeepSpeed's process groups, the shared-memory all-reduce of
deepspeed/ops/csrc/cpu/comm/shm_interface.cpp, which binds a process to its first MASTER_PORT for good).

Forking is safe because the parent computes nothing: torch's and OpenMP's thread pools start in the children.

The parent also loads DeepSpeed's CPU ops (OPS) before its first fork, building them on a machine that has none
yet: a rank then finds them loaded and never takes the build's lock file. torch's JIT build (cpp_extension) holds a
`lock` file while it checks or builds an op, and every later load waits for that file to go: a rank SIGKILLed in
that window (the pool ends the other ranks when one fails, a test's timeout ends them all) leaves the file behind,
and every later run of the session then waits forever. On a clean machine the first runs build the ops, so that
window was minutes long.
"""
import gc
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests import warm_ranks  # noqa: E402

SCRIPTS = {script: importlib.import_module(script.removesuffix(".py").replace("/", ".")).main
           for script in warm_ranks.SCRIPTS}
# what a run imports only when it needs it, imported once here so that no rank pays for it
LATER_IMPORTS = ("torchao.float8", "torchao.optim", "lm_eval.models.huggingface", "lm_eval.tasks", "accelerate",
                 "deepspeed.checkpoint.ds_to_universal", "torch.utils.tensorboard", "peft",
                 "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                 "transformers.models.gpt2.modeling_gpt2", "transformers.models.mixtral.modeling_mixtral")
# the ops the suite's runs load on the CPU accelerator: shared-memory all-reduce, ZeRO-Offload's and plain Adam
OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder")


def run_rank(script: str, rank: dict) -> int:
    """The script's main in this (forked) process, its output in the rank's files, as a process of its own would
    run it."""
    os.environ.update(rank["env"])
    args = rank["args"]
    sys.argv = [script, *args]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the jobs are the parent's to read
    os.close(null)
    with open(rank["stdout"], "wb") as out, open(rank["stderr"], "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    try:
        return SCRIPTS[script](args)
    except SystemExit as exit:  # argparse's usage errors
        return exit.code if isinstance(exit.code, int) else 1
    except BaseException:  # noqa: BLE001 (a process would print the traceback and exit 1)
        traceback.print_exc()
        return 1


def start(job: dict, reply_fd: int) -> dict[int, int]:
    """The job's ranks, forked: rank by process id."""
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for index, rank in enumerate(job["ranks"]):
        pid = os.fork()
        if pid == 0:
            os.close(reply_fd)
            code = 1
            try:
                code = run_rank(job["script"], rank)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        ranks[pid] = index
    return ranks


def load_ops() -> None:
    """OPS loaded in this process (built first where no earlier build is cached), so that no rank builds one."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":  # a GPU's ops are built by the runs that need them
        return
    for name in OPS:
        accelerator.create_op_builder(name).load()


def serve(reply_fd: int) -> None:
    for name in LATER_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library this environment lacks: no run here uses it
            pass
    load_ops()
    gc.freeze()  # the imports' objects: no rank's collections walk (and so copy) their pages
    os.write(reply_fd, b'{"ready": true}\n')
    for line in sys.stdin:
        ranks = start(json.loads(line), reply_fd)
        os.write(reply_fd, (json.dumps({"pids": list(ranks)}) + "\n").encode())
        while ranks:
            pid, status = os.wait()
            if pid in ranks:
                reply = {"rank": ranks.pop(pid), "code": os.waitstatus_to_exitcode(status)}
                os.write(reply_fd, (json.dumps(reply) + "\n").encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
    os._exit(0)  # no interpreter teardown: seconds for what the imports built
