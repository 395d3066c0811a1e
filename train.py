"""Train a recipe with DeepSpeed.

    deepspeed [launcher args] train.py --recipe NAME_OR_DIR [--output-dir DIR] [--dry-run] [--resume]
        [key.path=value ...]
    python train.py --recipe tiny_llama training.max_steps=20      # one process, no launcher
    python train.py --recipe llama2_7b --dry-run --num-gpus 8 --gpu-mem 80   # the plan for a machine you are not on

The story: validate the recipe and DeepSpeed config (exit 2 on bad input) -> prepare the data
(cached) -> build the model -> deepspeed.initialize -> train -> checkpoint and export to hf/.
"""
import argparse
import logging
import os
import signal
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

import training  # noqa: F401 (first: it keeps DeepSpeed's import from loading mlflow, training/compat/deepspeed/)
from data_pipeline.prepare import prepare_dataset
from data_pipeline.stream import StreamingBatches
from training.base.errors import ConfigError, positive_float, positive_int
from training.checks import check_layout, refusal
from training.compat import check_versions
from training.config.recipe import load_recipe, recipe_inputs
from training.loop.benchmarks import benchmark_run, check_benchmarks
from training.loop.engine import start_engine
from training.loop.metrics import (
    RunTotals,
    Stopwatch,
    flops_meter,
    measured_model_states,
    record_model_states,
    write_summary,
)
from training.loop.trackers import Trackers, check_trackers
from training.models.attention import resolve_attention
from training.models.compile import resolve_compile, with_cache_counts
from training.models.model import (
    check_checkpoint_folder,
    check_checkpoint_matches,
    check_recipe_against_model,
    load_model_config,
    load_tokenizer,
    weights_digest,
)
from training.models.moe import router_meter, with_router_loss
from training.objectives.base import Objective, objective_class
from training.parallel import distributed
from training.parallel.build import build_run_model
from training.parallel.op_builds import wait_for_op_builds
from training.planning.auto_config import choose_ds_config
from training.planning.ds_config import accumulation_steps, build_ds_config, load_ds_config, zero_setting, zero_stage
from training.planning.layout import ParallelDims
from training.planning.micro_batch import choose_micro_batch
from training.planning.plan import Machine, RunPlan, planned_machine
from training.planning.precision import resolve_precision
from training.planning.report import print_plan
from training.state.average import average_run
from training.state.checkpoint import latest_tag, resume_hint
from training.state.disk_room import check_room_to_start
from training.state.export import export_run
from training.state.output_dir import (
    check_output_dir,
    claim_output_dir,
    default_output_dir,
    finish_output_dir,
    start_output_dir,
)
from training.state.resume import plan_resume, resume_engine, saved_micro_batch
from training.state.run_state import RunState
from training.state.universal import convert_on_rank_0
from training.trainer import stop_requested, train


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="a name under recipes/, a recipe folder or a YAML file")
    parser.add_argument("--output-dir", type=Path,
                        help="default: outputs/<recipe>, or outputs/<recipe>-N when earlier runs are there")
    parser.add_argument("--dry-run", action="store_true", help="validate everything, print the plan, train nothing")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the output dir")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in the output dir")
    parser.add_argument("--num-gpus", type=positive_int, help="with --dry-run: plan for this many GPUs per node")
    parser.add_argument("--num-nodes", type=positive_int, default=1, help="with --dry-run and --num-gpus: nodes "
                        "(default 1)")
    parser.add_argument("--gpu-mem", type=positive_float, metavar="GiB", help="with --dry-run: memory per GPU to fit "
                        "into (default: this machine's)")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="e.g. training.max_steps=20")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the options


def make_plan(args: argparse.Namespace, world_size: int | None = None) -> RunPlan:
    """Every check that needs no model, data or process group: bad input fails here, fast. world_size:
    the ranks to plan for (default: --num-gpus x --num-nodes, or the launcher's)."""
    what_if = args.num_gpus is not None or args.gpu_mem is not None or args.num_nodes != 1
    if what_if and not args.dry_run:
        raise ConfigError("--num-gpus, --num-nodes and --gpu-mem plan for another machine: use them with --dry-run "
                          "(a run's ranks come from the deepspeed launcher)")
    if args.num_nodes != 1 and args.num_gpus is None:
        raise ConfigError(f"--num-nodes {args.num_nodes} plans for nodes of --num-gpus GPUs each: give --num-gpus too")
    recipe = load_recipe(args.recipe, args.overrides)
    check_trackers(recipe.logging.report_to)
    check_benchmarks(recipe)
    if recipe.model.name_or_path:
        check_checkpoint_folder(recipe.model.name_or_path)
    model_config = with_router_loss(load_model_config(recipe.model), recipe.moe)
    if recipe.model.config and recipe.model.name_or_path:
        check_checkpoint_matches(model_config, recipe.model)
    tokenizer = load_tokenizer(recipe.tokenizer_path, recipe.model.trust_remote_code, cached_only=args.dry_run)
    check_recipe_against_model(recipe, model_config, len(tokenizer) if tokenizer else None)
    recipe = resolve_attention(recipe, model_config, for_gpus=args.num_gpus is not None)
    world_size = world_size or (args.num_gpus * args.num_nodes if args.num_gpus else distributed.world_size())
    auto_config = recipe.deepspeed.config == "auto"
    machine = None
    if auto_config or recipe.training.micro_batch_size == "auto":
        machine = planned_machine(args.num_gpus, args.num_nodes, args.gpu_mem, world_size)
    if auto_config:
        precision = resolve_precision(recipe.precision, {}, for_gpus=args.num_gpus is not None)
        recipe = choose_ds_config(recipe, model_config, precision, machine,
                                  lambda chosen: refusal(chosen, model_config, world_size, args.num_gpus is not None))
    raw_ds_config, ds_config_path = load_ds_config(recipe)
    precision = resolve_precision(recipe.precision, raw_ds_config, for_gpus=args.num_gpus is not None)
    recipe = resolve_compile(recipe, zero_stage(raw_ds_config), for_gpus=args.num_gpus is not None)
    check_layout(recipe, model_config, raw_ds_config, precision, world_size, args.num_gpus is not None)
    dims = ParallelDims.of(recipe.parallelism, world_size)
    output_dir = args.output_dir or default_output_dir(recipe.name, args.resume)
    recipe, micro_batch = choose_micro_batch(recipe, model_config, precision, zero_setting(raw_ds_config), machine,
                                             dims.dp_size, saved_micro_batch(output_dir) if args.resume else None)
    if not args.dry_run:
        check_output_dir(output_dir, args.resume, args.overwrite, [*recipe_inputs(recipe), ds_config_path])

    def ds_config(universal: bool) -> dict:
        return build_ds_config(raw_ds_config, ds_config_path, recipe, model_config, dims.dp_size, precision, universal)

    plan = RunPlan(recipe, model_config, tokenizer, precision, ds_config(False), ds_config_path, dims,
                   accumulation_steps(recipe.training, dims.dp_size), output_dir,
                   chosen_for=machine if auto_config else None, micro_batch=micro_batch,
                   base_digest=weights_digest(recipe.model.name_or_path) if recipe.model.name_or_path else None)
    if args.resume and plan_resume(plan):  # the checkpoint loads in this layout only through a universal conversion
        plan = replace(plan, ds_config=ds_config(True), resume_universal=True)
    if not args.dry_run:
        check_room_to_start(plan, args.overwrite, args.resume)
    return plan


def show_plan(plan: RunPlan, machine: Machine) -> None:
    """--dry-run's report, with the objective's part."""
    print_plan(plan, machine, objective_class(plan.recipe.training.spec).describe(plan))


def make_batches(plan: RunPlan, objective: Objective) -> tuple:
    """The objective's training batches from prepared rows (local rank 0 prepares and caches them while the other
    ranks wait), or batches from a stream; evaluation batches when the data has an eval split; the data's stats."""
    data, section = plan.recipe.data, plan.recipe.training
    rank = plan.dims.dp_rank(dist.get_rank())
    if data.streaming:
        return StreamingBatches(data, plan.tokenizer, section.micro_batch_size, plan.accumulation_steps, rank,
                                plan.dims.dp_size, section.seed), None, {"streaming": True}
    with distributed.local_main_first():
        prepared, stats = prepare_dataset(data, plan.tokenizer)
    return *objective.batches(prepared, rank), stats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # DeepSpeed's old c10d calls
    try:
        distributed.adopt_srun_environment()
        distributed.check_master_port()
        check_versions(show=distributed.local_rank() == 0)
        plan = make_plan(args)
        if args.dry_run:
            show_plan(plan, planned_machine(args.num_gpus, args.num_nodes, args.gpu_mem, plan.dims.world_size))
            return 0
        wait_for_op_builds(show=distributed.local_rank() == 0)  # a build lock a killed run left is named
        if plan.planned_for and distributed.local_rank() == 0:
            show_plan(plan, plan.planned_for)  # why this DeepSpeed config or micro-batch
    except Exception as error:  # noqa: BLE001 (report_once raises again what is not a user error)
        return distributed.report_once(error)
    return distributed.run_in_process_group(lambda: run(plan, args), lambda: resume_hint(plan.output_dir))


def run(plan: RunPlan, args: argparse.Namespace) -> int:
    """Everything after the checks, inside the process group: data, model, engine, training, export. An error
    here on any rank ends every rank (training/parallel/failure.py)."""
    section, checkpoints = plan.recipe.training, plan.output_dir / "checkpoints"
    distributed.check_shared_folder(plan.output_dir)
    claim_output_dir(plan.output_dir, args.resume)
    objective = objective_class(section.spec)(plan)
    batches, evaluation, data_stats = make_batches(plan, objective)
    total_steps = section.total_steps(batches.steps_per_epoch)
    if plan.resume_universal:
        convert_on_rank_0(checkpoints, latest_tag(checkpoints))

    run_start = time.perf_counter()
    model, mpu, kernels = build_run_model(plan)
    engine = start_engine(plan, model, mpu, total_steps)
    start = resume_engine(engine, batches, plan, total_steps) if args.resume else \
        RunState(step=0, tokens_seen=0, data_position=0, **plan.layout().model_dump())
    # every check has passed: only now may --overwrite remove the earlier run
    start_output_dir(plan, args.overwrite, args.resume)
    objective.start(engine, batches, evaluation, args.resume)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_requested.set())  # from here a SIGTERM saves, then stops
    held_tensors = {}
    clock = Stopwatch()
    record_model_states(engine.optimizer, lambda: engine.global_steps, start.step + 1, held_tensors, clock)
    flops = flops_meter(plan)
    trackers = Trackers(plan, start.trackers, dist.get_rank() == 0)  # a resumed run continues its own
    try:
        totals = train(engine, objective, batches, evaluation, plan, start, total_steps, flops, trackers, clock,
                       router_meter(engine.module, plan.accumulation_steps))
    finally:
        objective.finish()
    totals.model_state_bytes, totals.kernels = measured_model_states(held_tensors), with_cache_counts(kernels)
    if totals.last_step < total_steps:
        trackers.finish(None)
        finish_output_dir(plan.output_dir)
        return stopped_early(plan, totals, total_steps)
    export_run(engine, plan)
    average_run(plan)  # checkpointing.average_last: hf_average/
    totals.benchmarks = benchmark_run(plan)  # eval.benchmarks: lm-eval on hf/
    trackers.finish(write_summary(plan, totals, start.step, total_steps, time.perf_counter() - run_start,
                                  data_stats, flops, objective.table))
    finish_output_dir(plan.output_dir)
    return 0


def stopped_early(plan: RunPlan, totals: RunTotals, total_steps: int) -> int:
    """Say why the run stopped before its last step and how to continue it: exit code 3 when the stability guard
    stopped it (a human should look), 0 after a SIGTERM (a preemption: the checkpoint is saved)."""
    by = "the stability guard" if totals.stopped else "SIGTERM"
    if dist.get_rank() == 0:
        print(f"stopped by {by} after step {totals.last_step} of {total_steps}"
              + (f": {totals.stopped}" if totals.stopped else "") +
              f"; the checkpoint is saved: continue with --resume --output-dir {plan.output_dir}", file=sys.stderr)
    return 3 if totals.stopped else 0


if __name__ == "__main__":
    exit_code = main()
    # Every output file is written and closed by now. Interpreter teardown can still abort a finished run:
    # a library's native thread destroyed during finalization ("terminate called without an active
    # exception", about 1 run in 50 on CPU ranks even with the process group destroyed), turning a good run's
    # exit code into a failure. So the process ends here, without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
