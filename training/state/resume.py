"""--resume, checked before anything is built: the checkpoint `latest` names against the run about to start. Whether
it is damaged, does not fit this run (another model, tokenizer or LoRA base), or loads only through a universal
checkpoint (another layout) is each said here with its way out (training/state/checkpoint.py, training/state/universal.py)."""
from training.state.checkpoint import check_files, check_resume, latest_tag
from training.models.model import check_resumed_model
from training.parallel.pipeline import layer_files
from training.planning.plan import RunPlan
from training.state.universal import with_universal_load


def plan_resume(plan: RunPlan) -> None:
    """Every check of the checkpoint to resume; sets `plan.resume_universal`, and then the DeepSpeed config that
    records the universal load."""
    checkpoints = plan.output_dir / "checkpoints"
    plan.resume_universal = check_resume(checkpoints, plan.layout(), plan.recipe, plan.base_digest)
    tag = latest_tag(checkpoints)
    check_resumed_model(checkpoints / tag, plan.model_config, plan.tokenizer)
    if plan.pipeline_stages > 1:
        check_files(checkpoints, tag, layer_files(plan.model_config))
    if plan.resume_universal:
        plan.ds_config = with_universal_load(plan.ds_config)
