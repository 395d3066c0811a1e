"""The recipe's checks that read more than one section: data.phases and data.seq_len_warmup against training and
parallelism, checkpointing.average_last against the saves a run makes. recipe.py's validator calls them."""
from data_pipeline.config import DataConfig
from data_pipeline.curriculum import phase_steps
from training.config.sections import CheckpointingSection, LoraSection, ParallelismSection, TrainingSection


def check_phases(data: DataConfig, training: TrainingSection) -> None:
    """data.phases against the run: packed documents, a fixed length, the decay phase last under WSD."""
    phases = data.phases
    if data.examples != "documents":
        raise ValueError(f"data.phases mixes packed documents (training.objective lm or distill), and "
                         f"{training.objective} trains on {training.spec.trains_on}; weight its sources with "
                         f"data.sources' weight")
    if training.max_steps is None:
        raise ValueError("data.phases: set training.max_steps (the phases' steps add up to it) in place of "
                         "training.epochs")
    for index, phase in enumerate(phases):
        if phase.steps == "decay" and (index != len(phases) - 1 or training.schedule != "wsd"):
            raise ValueError(f"data.phases.{index} ({phase.name}) lasts the WSD schedule's decay: it must be the "
                             f"last phase and training.schedule wsd (it is {training.schedule})")
    phase_steps(phases, training.max_steps, training.decay_steps(training.max_steps),
                training.global_batch_size * data.seq_len)


def check_average(checkpointing: CheckpointingSection, training: TrainingSection, lora: LoraSection) -> None:
    """checkpointing.average_last: the run saves and keeps that many checkpoints of the model's weights."""
    max_steps = training.max_steps
    last, every = checkpointing.average_last, checkpointing.every_steps
    if lora.enabled:
        raise ValueError("checkpointing.average_last averages the model's weights, and a LoRA run's checkpoints "
                         "hold adapters: remove it (or average merged exports with python -m training average)")
    if every is None:
        raise ValueError(f"checkpointing.average_last={last} averages the run's last {last} checkpoints: set "
                         f"checkpointing.every_steps (without it the run saves one, at the end)")
    if checkpointing.keep_last is not None and checkpointing.keep_last < last:
        raise ValueError(f"checkpointing.keep_last={checkpointing.keep_last} removes checkpoints that "
                         f"checkpointing.average_last={last} averages: keep at least {last}")
    if max_steps is not None and (saves := len(checkpointing.save_steps(max_steps))) < last:
        raise ValueError(f"checkpointing.average_last={last}: training.max_steps={max_steps} with "
                         f"checkpointing.every_steps={every} saves {saves} checkpoints; save more often or average "
                         f"fewer")


def check_seq_len_warmup(data: DataConfig, training: TrainingSection, parallelism: ParallelismSection) -> None:
    """data.seq_len_warmup cuts prepared rows of documents, into micro-batches whose shape changes."""
    start, objective = data.seq_len_warmup.start, training.objective
    if objective != "lm" or data.streaming:
        raise ValueError(f"data.seq_len_warmup cuts the prepared rows of packed documents (training.objective lm, "
                         f"not data.streaming); this run is {objective}"
                         + (" on data.streaming" if data.streaming else "") + ": remove it")
    if parallelism.pipeline_stages > 1:
        raise ValueError("data.seq_len_warmup changes the micro-batches' shape, and DeepSpeed's pipeline engine "
                         "passes activations of one shape between stages: remove it or parallelism.pipeline_stages")
    if start % parallelism.sequence_parallel:
        raise ValueError(f"data.seq_len_warmup.start={start} does not split over parallelism.sequence_parallel="
                         f"{parallelism.sequence_parallel} ranks: use a multiple of it")
