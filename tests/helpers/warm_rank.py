"""One warm rank of the test suite's rank pool (tests/warm_ranks.py): a process that imports the product once, then
runs one job after another in-process, each as the `deepspeed` launcher would have run it in a fresh process.

    python tests/helpers/warm_rank.py REPLY_FD

A job is a JSON line on stdin: {"script", "args", "env", "stdout", "stderr"}. The worker sets `env` (the rank
variables the launcher sets, MASTER_PORT new for each job), sends its file descriptors 1 and 2 to the two files,
calls the script's `main(args)` and writes {"code": exit code} to REPLY_FD. Then it puts back the state the imports
left (`Baseline`), so that the next job starts as a fresh process would. A job that ends its process (the failure
watch's os._exit, a kill) ends the worker: the pool sees its exit code and starts another.
"""
import functools
import gc
import importlib
import json
import logging
import os
import random
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import deepspeed.comm  # noqa: E402
from deepspeed import DeepSpeedEngine  # noqa: E402

import train  # noqa: E402
from tests import warm_ranks  # noqa: E402

SCRIPTS = {script: importlib.import_module(script.removesuffix(".py").replace("/", ".")).main
           for script in warm_ranks.SCRIPTS}
# the libraries a run may patch or fill (the product's compat patches, the probes, DeepSpeed's and transformers'
# registries and caches): their modules, the classes they define and their module-level dicts and objects
WATCHED = ("train", "training", "data_pipeline", "benchmarks", "tests", "deepspeed", "transformers", "peft", "accelerate",
           "datasets", "torchao", "lm_eval")
# what a run imports only when it needs it, imported before the baseline is taken, so that it is watched too
LATER_IMPORTS = ("torchao.float8", "torchao.optim", "lm_eval.models.huggingface", "lm_eval.tasks", "accelerate",
                 "deepspeed.checkpoint.ds_to_universal", "torch.utils.tensorboard")


def watched_modules() -> list:
    return [module for name, module in list(sys.modules.items())
            if module is not None and name.split(".")[0] in WATCHED and name != __name__]


class Baseline:
    """The process state a run may change, taken once the imports are done, and put back after each run: module
    attributes, class attributes, the attributes of module-level objects and the contents of the dicts, lists and
    sets any of these hold (registries such as transformers' attention functions, DeepSpeed's list of the modules it
    hooked), in the watched libraries; environment variables, sys.path, the working directory, signal handlers, warning filters,
    logger settings, random generators and torch's global switches. The functools caches of the watched libraries
    are emptied."""

    def __init__(self):
        self.namespaces: dict[int, tuple[object, dict]] = {}
        for module in watched_modules():
            self.keep(module, vars(module))
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == module.__name__:
                    self.keep(value, vars(value))
                elif type(value) in (dict, list, set):
                    self.keep(value, value)
                elif hasattr(value, "__dict__") and type(value).__module__.split(".")[0] in WATCHED \
                        and not isinstance(value, (type, torch.nn.Module)):
                    self.keep(value, vars(value))
        for _, kept in list(self.namespaces.values()):  # registries: containers held by a class or an object
            for value in kept.values() if type(kept) is dict else ():
                if type(value) in (dict, list, set):
                    self.keep(value, value)
        cached = type(functools.cache(len))
        self.caches = [cache for cache in gc.get_objects() if issubclass(type(cache), cached)
                       and (getattr(cache, "__module__", None) or "").split(".")[0] in WATCHED]
        self.environ = dict(os.environ)
        self.path, self.cwd = list(sys.path), os.getcwd()
        self.handlers = {number: signal.getsignal(number) for number in signal.valid_signals()
                         if signal.getsignal(number) is not None}
        self.filters = list(warnings.filters)
        self.loggers = {name: (logger.level, logger.disabled, logger.propagate, list(logger.handlers))
                        for name, logger in logging.root.manager.loggerDict.items()
                        if isinstance(logger, logging.Logger)}
        self.root = (logging.root.level, list(logging.root.handlers))
        self.random = (random.getstate(), numpy.random.get_state(), torch.get_rng_state())
        self.torch = (torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled(),
                      torch.are_deterministic_algorithms_enabled())

    def keep(self, owner: object, namespace) -> None:
        if id(owner) not in self.namespaces:
            self.namespaces[id(owner)] = (owner, namespace.copy() if type(namespace) in (list, set) else dict(namespace))

    def restore(self) -> None:
        if dist.is_initialized():  # a run that left its group (a failure before the teardown)
            dist.destroy_process_group()
        torch._dynamo.reset()
        # torch's autograd engine keeps the last backward's graph task (ZeRO-3's final callback, holding its
        # partitions: 12 MB on the small model) until the next backward: one on a scalar lets it go
        torch.ones(1, requires_grad=True).sum().backward()
        gc.collect()  # the run's engines and tensors: the next run's census counts no leftovers
        for owner, kept in self.namespaces.values():
            if type(owner) in (list, set):  # a module's list of live objects (DeepSpeed's hooked modules), a set
                if len(owner) != len(kept) or any(a is not b for a, b in zip(owner, kept)):
                    owner.clear()
                    owner.update(kept) if type(owner) is set else owner.extend(kept)
                continue
            current = owner if type(owner) is dict else vars(owner)
            for key in [key for key in current if key not in kept]:
                self.drop(owner, key)
            for key, value in kept.items():
                if current.get(key, current) is not value:
                    self.put(owner, key, value)
        for cache in self.caches:  # they hold the run's objects (DeepSpeed caches per engine)
            cache.cache_clear()
        train.stop_requested.clear()
        os.environ.clear()
        os.environ.update(self.environ)
        sys.path[:] = self.path
        os.chdir(self.cwd)
        for number, handler in self.handlers.items():
            if signal.getsignal(number) is not handler:
                signal.signal(number, handler)
        warnings.filters[:] = self.filters
        warnings._filters_mutated()
        for name, (level, disabled, propagate, handlers) in self.loggers.items():
            logger = logging.getLogger(name)
            logger.level, logger.disabled, logger.propagate, logger.handlers = level, disabled, propagate, list(handlers)
        logging.root.level, logging.root.handlers = self.root[0], list(self.root[1])
        logging.root.manager._clear_cache()
        random.setstate(self.random[0])
        numpy.random.set_state(self.random[1])
        torch.set_rng_state(self.random[2])
        dtype, threads, grad, deterministic = self.torch
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic)

    @staticmethod
    def drop(owner: object, key: str) -> None:
        if type(owner) is dict:
            del owner[key]
        elif isinstance(owner, type):
            delattr(owner, key)
        else:
            vars(owner).pop(key)

    @staticmethod
    def put(owner: object, key: str, value: object) -> None:
        if type(owner) is dict:
            owner[key] = value
        elif isinstance(owner, type):
            setattr(owner, key, value)
        else:
            vars(owner)[key] = value


def destroying_engines_first(teardown: Callable[[], None]) -> Callable[[], None]:
    """The process-group teardown, after destroying the run's DeepSpeed engines: their optimizers' gradient hooks
    make a cycle through torch's autograd that gc cannot free (a process's exit frees it), and DeepSpeed's destroy()
    needs the group."""
    def teardown_after_engines(*args, **kwargs):
        for engine in [obj for obj in gc.get_objects() if issubclass(type(obj), DeepSpeedEngine)]:  # not a dead proxy
            engine.destroy()
        return teardown(*args, **kwargs)

    return teardown_after_engines


def run_job(job: dict) -> int:
    """The job's script in this process, its output in the job's files, as a process of its own would run it. A
    failed run may leave objects behind (an engine that was not destroyed): the pool replaces a worker whose run
    failed."""
    deepspeed.comm.destroy_process_group = destroying_engines_first(deepspeed.comm.destroy_process_group)
    os.environ.update(job["env"])
    sys.argv = [job["script"], *job["args"]]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(job["stdout"], "wb") as out, open(job["stderr"], "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            return SCRIPTS[job["script"]](job["args"])
        except SystemExit as exit:  # argparse's usage errors
            return exit.code if isinstance(exit.code, int) else 1
        except BaseException:  # noqa: BLE001 (a process would print the traceback and exit 1)
            traceback.print_exc()
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def tensor_storages() -> dict[int, tuple[int, str]]:
    """The storages of the tensors this process holds, as the product's census counts them: bytes and a tensor's
    shape and dtype, by address."""
    storages = {}
    for tensor in [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]:
        try:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes(), f"{tuple(tensor.shape)} {tensor.dtype}"
        except (RuntimeError, NotImplementedError):  # a meta or fake tensor, a freed storage
            continue
    return storages


def leftovers(held: dict[int, tuple[int, str]]) -> int:
    """Bytes of the tensors alive now that were not when the worker was ready; the largest are logged when they
    retire the worker."""
    new = sorted((value for address, value in tensor_storages().items() if address not in held), reverse=True)
    total = sum(nbytes for nbytes, _ in new)
    if total > LEFTOVER_BYTES:
        print(f"retiring: the run left {total} bytes of tensors, the largest {new[:5]}", file=sys.stderr, flush=True)
    return total


LEFTOVER_BYTES = 1 << 20  # tensors a run left alive beyond these: the worker retires (the next census would count them)


def serve(reply_fd: int) -> None:
    for name in LATER_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library this environment lacks: no run here uses it
            pass
    baseline = Baseline()
    held = tensor_storages()
    os.write(reply_fd, b'{"ready": true}\n')
    for line in sys.stdin:
        try:
            code = run_job(json.loads(line))
        finally:
            baseline.restore()
        # what a failed run, or anything the restore does not reach, left alive: a fresh process takes over
        retire = code != 0 or leftovers(held) > LEFTOVER_BYTES
        os.write(reply_fd, (json.dumps({"code": code, "retire": retire}) + "\n").encode())
        if retire:
            return


if __name__ == "__main__":
    serve(int(sys.argv[1]))
    os._exit(0)
