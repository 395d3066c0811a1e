"""train.py with test probes, run through the deepspeed launcher like train.py itself:

    deepspeed tests/helpers/train_with_probes.py [--kill-after-deepspeed-save STEP] [--record-logits]
        [--fail-on-rank RANK] [--blind-node-on-rank RANK] [--slow-save SECONDS] [--sigterm-in-step STEP]
        [--hold-in-step STEP:RANK:MARKER] [--hold-in-save STEP:RANK:MARKER] [--hold-in-write STEP:SECONDS:MARKER]
        <train.py args>

--kill-after-deepspeed-save STEP: every rank SIGKILLs itself once DeepSpeed has written its files for
    that step's checkpoint, after truncating them: a kill in the middle of a save, before `latest` moves.
--record-logits: after training, the trained engine runs on the first micro-batch; the rank that holds the
    logits writes them with the batch to <output dir>/engine_logits.pt, to compare with the exported hf/.
--fail-on-rank RANK: that rank raises a RuntimeError (a bug, not bad input) in its third training step, while
    the other ranks go on into the step's collectives.
--blind-node-on-rank RANK: that rank acts as the first rank of another node, one that cannot see the output
    folder (a node-local disk).
--slow-save SECONDS: DeepSpeed takes that much longer to write every checkpoint.
--sigterm-in-step STEP: rank 0 is sent SIGTERM as that step begins.
--hold-in-step STEP:RANK:MARKER, --hold-in-save STEP:RANK:MARKER: that rank writes the file MARKER and sleeps (HOLD_S)
    as that step begins, or in that step's checkpoint save once DeepSpeed has written its files (before `latest`
    moves): the other ranks wait for it in a collective, and a test kills or stops its node there.
--hold-in-write STEP:SECONDS:MARKER: every rank's background writer (checkpointing.asynchronous) holds that step's
    files unwritten for SECONDS while training goes on; rank 0 writes the file MARKER as it begins to hold.
--record-routing [--route-by-rank | --route-across]: the experts each MoE router picks in the first step, per rank
    (routing_rank{r}.json); with --route-by-rank the ranks' tokens go to disjoint experts, with --route-across to
    the next rank's experts.
--insert-poisoned-batches KIND:POSITIONS[:RANK]: poisoned batches are inserted into the data at those data
    positions (comma-separated), pushing the data's own batches back: `nonfinite` makes the model's embedding
    output infinite, `spike` multiplies the LM head's input by 30, so its logits (a finite loss spike, also under the
    fused loss, whose head returns the loss), on RANK only or on every rank.
    Without the poisoned batches, a run reads exactly the data of a run without this probe.
"""
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import train  # noqa: E402
from data_pipeline.loader import StepBatches  # noqa: E402
from training import trainer  # noqa: E402
from training.compat.deepspeed.background_save import BackgroundWriter  # noqa: E402
from training.models.moe import AUTOEP_ROUTER, routed_experts  # noqa: E402
from training.parallel import distributed  # noqa: E402
from training.parallel.pipeline import pipeline_batches  # noqa: E402


def files_written(engine: DeepSpeedEngine) -> None:
    """DeepSpeed's files of the save on disk, also where a background writer writes them."""
    if isinstance(engine.checkpoint_engine, BackgroundWriter):
        engine.checkpoint_engine.wait()


def kill_after_deepspeed_save(step: int) -> None:
    save = DeepSpeedEngine.save_checkpoint

    def save_then_die(engine, save_dir, tag=None, **kwargs):
        result = save(engine, save_dir, tag=tag, **kwargs)
        if tag == f"global_step{step}":
            files_written(engine)
            for path in (Path(save_dir) / tag).glob(f"*rank_{dist.get_rank()}_*.pt"):
                path.write_bytes(path.read_bytes()[:100])  # as if the kill came mid-write
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    DeepSpeedEngine.save_checkpoint = save_then_die


def fail_on_rank(rank: int) -> None:
    step = trainer.train_step

    def step_or_fail(engine, *args, **kwargs):
        if dist.get_rank() == rank and engine.global_steps == 2:
            raise RuntimeError(f"probe: rank {rank} fails in step 3")
        return step(engine, *args, **kwargs)

    trainer.train_step = step_or_fail


def sigterm_in_step(step: int) -> None:
    """Rank 0 is sent SIGTERM as step `step` begins, as a preemption would (train.py's handler sets the flag that
    the step's all-reduce spreads to the other ranks)."""
    run_step = trainer.train_step

    def step_with_sigterm(engine, *args, **kwargs):
        if dist.get_rank() == 0 and engine.global_steps == step - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return run_step(engine, *args, **kwargs)

    trainer.train_step = step_with_sigterm


HOLD_S = 300.0


def hold_here(rank: int, marker: str) -> None:
    if dist.get_rank() == rank:
        Path(marker).write_text(str(os.getpid()))
        time.sleep(HOLD_S)


def hold_in_step(spec: str) -> None:
    step, rank, marker = spec.split(":", 2)
    run_step = trainer.train_step

    def step_with_hold(engine, *args, **kwargs):
        if engine.global_steps == int(step) - 1:
            hold_here(int(rank), marker)
        return run_step(engine, *args, **kwargs)

    trainer.train_step = step_with_hold


def hold_in_save(spec: str) -> None:
    step, rank, marker = spec.split(":", 2)
    save = DeepSpeedEngine.save_checkpoint

    def save_with_hold(engine, save_dir, tag=None, **kwargs):
        result = save(engine, save_dir, tag=tag, **kwargs)
        if tag == f"global_step{step}":
            files_written(engine)
            hold_here(int(rank), marker)
        return result

    DeepSpeedEngine.save_checkpoint = save_with_hold


def hold_in_write(spec: str) -> None:
    step, seconds, marker = spec.split(":", 2)
    write = BackgroundWriter.write

    def write_with_hold(writer, jobs):
        if any(f"/global_step{step}/" in str(getattr(job, "args", ("", ""))[1:2]) for job in jobs):
            if dist.get_rank() == 0:
                Path(marker).write_text(str(os.getpid()))
            time.sleep(float(seconds))
        return write(writer, jobs)

    BackgroundWriter.write = write_with_hold


def blind_node_on_rank(rank: int) -> None:
    if int(os.environ.get("RANK", "0")) == rank:
        distributed.local_rank = lambda: 0
        distributed.marker_seen = lambda marker, wait_s=5.0: False


def slow_save(seconds: float) -> None:
    save = DeepSpeedEngine.save_checkpoint

    def save_slowly(*args, **kwargs):
        time.sleep(seconds)
        return save(*args, **kwargs)

    DeepSpeedEngine.save_checkpoint = save_slowly


def record_logits() -> None:
    """After training, the trained engine's logits on the run's first micro-batch (through the pipeline's
    own evaluation schedule when there are stages), saved by the rank that holds them."""
    run = train.train

    def train_and_record(engine, objective, batches, *args, **kwargs):
        totals = run(engine, objective, batches, *args, **kwargs)
        batch = batches.micro_batches(0)[0]
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        if isinstance(engine, PipelineEngine):
            _, logits = engine.eval_batch(pipeline_batches([batch]), return_logits=True, num_micro_batches=1)
            holder = engine.is_last_stage() and engine.grid.data_parallel_id == 0
        else:
            engine.eval()
            with torch.no_grad():
                logits = engine(**{k: v.to(engine.device) for k, v in inputs.items()}).logits
            engine.train()
            holder = dist.get_rank() == 0
        if holder:
            torch.save({**inputs, "logits": logits.float().cpu()},
                       Path(kwargs.get("plan", args[1]).output_dir) / "engine_logits.pt")
        return totals

    train.train = train_and_record


def insert_poisoned_batches(spec: str) -> None:
    kind, positions, *rank = spec.split(":")
    poisoned = sorted(int(p) for p in positions.split(","))
    factor = {"nonfinite": math.inf, "spike": 30.0}[kind]
    state = {"poisoned": False}
    read = StepBatches.micro_batches

    def read_with_poison(batches, position):
        state["poisoned"] = position in poisoned
        return read(batches, position - sum(p < position for p in poisoned))

    def poisoned_here() -> bool:
        return state["poisoned"] and (not rank or dist.get_rank() == int(rank[0]))

    def poison_output(module, inputs, output):
        return output * factor if poisoned_here() else output

    def poison_head_input(module, inputs):  # the logits times factor, also where the head computes the fused loss
        return (inputs[0] * factor, *inputs[1:]) if poisoned_here() else inputs

    run = train.train

    def train_with_hook(engine, *args, **kwargs):
        if kind == "nonfinite":
            engine.module.get_input_embeddings().register_forward_hook(poison_output)
        else:
            engine.module.get_output_embeddings().register_forward_pre_hook(poison_head_input)
        return run(engine, *args, **kwargs)

    StepBatches.micro_batches = read_with_poison
    train.train = train_with_hook


def record_routing(route: str | None) -> None:
    """The experts each MoE router picks for this rank's tokens in the first optimizer step, by layer, written to
    <output dir>/routing_rank{r}.json. route="by-rank": every router sends rank r's tokens to experts r*k .. r*k + k-1
    instead of its own top-k (with its own top-k weights), so that the ranks use disjoint experts; "across": to the
    experts of rank r+1 (r+1)*k .. (r+1)*k + k-1, which under expert parallelism over 2 ranks with 2k experts are
    all held by the other rank of the pair. Both transformers' routers and AutoEP's."""
    run = train.train
    shift = {"by-rank": 0, "across": 1}.get(route)

    def route_by_rank(module, inputs, output):
        indices = routed_experts(module, output)
        first = (dist.get_rank() + shift) * module.top_k % module.num_experts
        forced = (torch.arange(module.top_k, device=indices.device) + first).expand_as(indices).contiguous()
        if type(module).__name__ == AUTOEP_ROUTER:  # (weights, experts, tokens per expert)
            return output[0], forced, torch.bincount(forced.reshape(-1), minlength=module.num_experts).to(output[2])
        return output[0], output[1], forced

    def train_and_record(engine, *args, **kwargs):
        picked, routers = {}, [m for m in engine.module.modules() if type(m).__name__.endswith("TopKRouter")]
        if shift is not None:
            for router in routers:  # before the run's own hooks (the router meter's), which see the routing used
                router.register_forward_hook(route_by_rank, prepend=True)

        def note(layer):
            def hook(module, inputs, output):
                if engine.global_steps == 0:
                    picked.setdefault(layer, set()).update(routed_experts(module, output).flatten().tolist())
            return hook

        for layer, router in enumerate(routers):
            router.register_forward_hook(note(layer))
        totals = run(engine, *args, **kwargs)
        out = Path(kwargs.get("plan", args[3]).output_dir) / f"routing_rank{dist.get_rank()}.json"
        out.write_text(json.dumps({layer: sorted(experts) for layer, experts in picked.items()}))
        return totals

    train.train = train_and_record


PROBES = {"--kill-after-deepspeed-save": lambda value: kill_after_deepspeed_save(int(value)),
          "--fail-on-rank": lambda value: fail_on_rank(int(value)),
          "--blind-node-on-rank": lambda value: blind_node_on_rank(int(value)),
          "--slow-save": lambda value: slow_save(float(value)),
          "--sigterm-in-step": lambda value: sigterm_in_step(int(value)),
          "--hold-in-step": hold_in_step, "--hold-in-save": hold_in_save, "--hold-in-write": hold_in_write,
          "--insert-poisoned-batches": insert_poisoned_batches}


def main(argv: list[str]) -> int:
    """Install the probes that argv asks for, then train.py's main with the rest (a rank forked by the warm ranks of
    tests/warm_ranks.py calls it too)."""
    args = list(argv)
    for option, install in PROBES.items():
        if option in args:
            at = args.index(option)
            install(args[at + 1])
            del args[at:at + 2]
    if "--record-routing" in args:
        args.remove("--record-routing")
        route = next((arg.removeprefix("--route-") for arg in args if arg in ("--route-by-rank", "--route-across")),
                     None)
        record_routing(route)
        args = [arg for arg in args if arg not in ("--route-by-rank", "--route-across")]
    if "--record-logits" in args:
        args.remove("--record-logits")
        record_logits()
    return train.main(args)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as train.py ends
