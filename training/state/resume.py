"""--resume: the checkpoint `latest` names, checked against the run about to start before anything is built, then
loaded. Whether it is damaged, does not fit this run (another model, tokenizer or LoRA base), or loads only through a
universal checkpoint (another layout) is each said before anything is built, with its way out
(training/state/checkpoint.py, training/state/universal.py)."""
from pathlib import Path

from deepspeed import DeepSpeedEngine

from data_pipeline.loader import StepBatches
from data_pipeline.stream import StreamingBatches
from training.base.errors import ConfigError
from training.models.model import check_resumed_model
from training.parallel.pipeline import layer_files
from training.planning.plan import RunPlan
from training.state.checkpoint import (
    check_files,
    check_resume,
    latest_tag,
    load_checkpoint,
    read_run_state,
    remove_unfinished_tags,
)
from training.state.run_state import RunState
from training.state.universal import check_conversion_place


def plan_resume(plan: RunPlan) -> bool:
    """Every check of the checkpoint to resume; whether it loads into the plan's layout only through a universal
    checkpoint."""
    checkpoints = plan.output_dir / "checkpoints"
    universal = check_resume(checkpoints, plan.layout(), plan.recipe, plan.base_digest)
    tag = latest_tag(checkpoints)
    check_resumed_model(checkpoints / tag, plan.model_config, plan.tokenizer)
    if plan.dims.pipeline_stages > 1:
        check_files(checkpoints, tag, layer_files(plan.model_config))
    if universal:
        check_conversion_place(checkpoints, tag)
    return universal


def saved_micro_batch(output_dir: Path) -> int | None:
    """The micro-batch the latest checkpoint was trained with (training.micro_batch_size=auto keeps it); None when it
    is not recorded or cannot be read (plan_resume then says why)."""
    try:
        return read_run_state(output_dir / "checkpoints").micro_batch_size
    except ConfigError:
        return None


def resume_engine(engine: DeepSpeedEngine, batches: StepBatches | StreamingBatches, plan: RunPlan,
                  total_steps: int) -> RunState:
    """Load the latest checkpoint into the engine and the batches, once saves a kill interrupted past it are removed.
    Returns where the run starts: the checkpoint's run state, in this run's layout (its states now are)."""
    checkpoints = plan.output_dir / "checkpoints"
    remove_unfinished_tags(checkpoints)
    start, data_state = load_checkpoint(engine, checkpoints, plan.layout())
    batches.load_state_dict(data_state)
    if start.step >= total_steps:
        raise ConfigError(f"--resume: the checkpoint is at step {start.step}; the recipe ends at {total_steps} "
                          f"steps, so there is nothing left to train")
    return start.model_copy(update=plan.layout().model_dump())
