"""training.objective=distill before anything is built: its recipe section (TRL's GKDConfig names), traits, and its
check against the rest of the recipe."""
from typing import ClassVar, Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt

from training.base.schema import HubIdOrPath, StrictModel
from training.objectives.grpo.spec import GrpoSection
from training.objectives.spec import TRL_SHARED_NAMES, HeadTraits, ObjectiveSpec

# TRL's ChunkedDivergenceFunction projects both heads over (tokens, vocabulary entries) tiles of this size, two fp32
# buffers of it (training/compat/trl.py; tests/training/compat/test_trl.py holds TRL to these numbers)
DIVERGENCE_TILE = (4096, 32768)


class DistillSection(StrictModel):
    """training.objective=distill (training/objectives/distill/): the student learns the teacher's next-token
    distributions, TRL's generalized Jensen-Shannon divergence between the two at every target token."""
    teacher_model_name_or_path: HubIdOrPath | None = None  # the teacher: a causal LM checkpoint with the student's
    # vocabulary (a local folder, or a hub id), frozen, in the run's precision
    beta: float = Field(0.5, ge=0.0, le=1.0)  # the divergence: 0 the forward KL(teacher || student), 1 the reverse
    # KL(student || teacher), between them the generalized JSD with the mixture (1 - beta) student + beta teacher
    temperature: PositiveFloat = 0.9  # both models' logits divided by it before the divergence (TRL's
    # DistillationTrainer; GKDTrainer's loss takes 1) and the student's samples drawn at it
    lmbda: float = Field(0.5, ge=0.0, le=1.0)  # the share of each step's sequences that are the student's own
    # completions of the data's prompts (on-policy, GKD); 0: the data's own completions alone
    seq_kd: bool = False  # the off-policy sequences are the teacher's samples of the prompts, not the data's
    # completions (sequence-level KD)
    max_new_tokens: PositiveInt = 128  # a sampled completion's length at most
    generation_engine: Literal["auto", "generate", "static", "compiled"] = "auto"  # what samples: GRPO's in-process
    # engines (grpo.generation_engine, docs/grpo.md), which sample the same completions; auto: generate
    lm_loss_weight: NonNegativeFloat = 0.0  # the student's next-token loss over the same tokens, this many times,
    # added to the divergence (0: the divergence alone, as TRL's)
    disable_dropout: bool = True  # the student's dropout off (TRL's default); the teacher runs in eval mode
    trl_names: ClassVar[dict[str, str]] = {  # GKDConfig's and DistillationConfig's, for the unknown-key error
        "teacher_model_init_kwargs": "the teacher loads as the student does: in the run's precision, with "
                                     "model.attn_implementation and model.trust_remote_code",
        "max_length": "write data.seq_len",
        "max_completion_length": "write distill.max_new_tokens (GKDConfig's name)",
        "use_liger_kernel": "the loss is always chunked (TRL's chunked divergence, Triton on a GPU)",
        **TRL_SHARED_NAMES,
    }


def check_recipe(recipe) -> None:
    """The distill section against the rest of the recipe (`recipe`: the validated Recipe)."""
    section = recipe.distill
    if section.teacher_model_name_or_path is None:
        raise ValueError("distill.teacher_model_name_or_path is not set: name the teacher, a causal LM checkpoint "
                         "with the student's tokenizer (a local folder or a hub id)")
    if not samples(section):
        return
    data, why = recipe.data, f"distill.lmbda={section.lmbda:g}" if section.lmbda else "distill.seq_kd"
    documents = [index for index, source in enumerate(data.sources) if source.messages_field is None]
    if documents:
        raise ValueError(f"{why} samples completions of the data's prompts, and data.sources[{documents[0]}] holds "
                         f"documents (text_field), which have none: give chat data (messages_field), or set "
                         f"distill.lmbda=0 and seq_kd=false to distill on the documents' tokens")
    if data.packing != "none":
        raise ValueError(f"{why} replaces a conversation's completion with a sample of another length: set "
                         f"data.packing=none (a row per conversation), or distill.lmbda=0 and seq_kd=false")
    if section.max_new_tokens >= data.seq_len:
        raise ValueError(f"distill.max_new_tokens={section.max_new_tokens} leaves no room for a prompt in a row of "
                         f"data.seq_len={data.seq_len}: lower it")


def samples(section: DistillSection) -> bool:
    """Whether a step samples sequences (on-policy, or the teacher's with seq_kd)."""
    return section.lmbda > 0 or section.seq_kd


def sampling_section(section: DistillSection) -> GrpoSection:
    """GRPO's sampling settings for distill's samples (training/objectives/distill/on_policy.py): GKD's temperature
    and max_new_tokens, no top-k or top-p, the engine; every rank decoding together under ZeRO-3, its weights
    partitioned."""
    return GrpoSection(temperature=section.temperature, max_completion_length=section.max_new_tokens,
                       generation_engine=section.generation_engine, ds3_gather_for_generation=False)


def head_traits(section: DistillSection) -> HeadTraits:
    return HeadTraits(divergence_tile=DIVERGENCE_TILE)


def input_paths(section: DistillSection) -> list[str | None]:
    return [section.teacher_model_name_or_path]


REFUSED_LAYOUTS = {  # the parallel degrees distill does not run with (training/parallel/support.py)
    "pipeline_stages": "the last stage would need the teacher's hidden states of each micro-batch; not built",
    "tensor_parallel": "the teacher and the loss would need the head's vocabulary split over the ranks; not built",
    "sequence_parallel": "not built: the teacher would run on each rank's slice of the rows",
    "expert_parallel": "not built",
}

DISTILL = ObjectiveSpec(name="distill", runtime="training.objectives.distill.objective:Distill",
                        trains_on="a teacher's next-token distributions", model_loss=False, rows_per_example=1,
                        unit="rows", examples="documents", memory="training.objectives.distill.memory:distill_memory",
                        settings=DistillSection, head_traits=head_traits, check_recipe=check_recipe,
                        input_paths=input_paths, refused_layouts=REFUSED_LAYOUTS)
