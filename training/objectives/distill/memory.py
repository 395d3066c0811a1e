"""distill's memory beside the trained model's states, estimated before a run (its spec's `memory`, distill_memory):
the frozen teacher. Plan-time code, at the planning layer (tests/test_import_order.py); the teacher's config, which
the plan and the run's checks read, is read here."""
from functools import cache
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from training.base.errors import ConfigError
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.objectives.distill.spec import samples, sampling_section
from training.objectives.grpo.memory import generation
from training.planning.objective_memory import ObjectiveMemory
from training.planning.precision import weights_dtype
from training.planning.shape import ModelShape, model_shape


@cache
def teacher_config(name_or_path: str, trust_remote_code: bool) -> PretrainedConfig:
    """The teacher's architecture (its config.json), without a KV cache: with one, transformers stops deriving each
    packed document's attention mask from position_ids (training/models/model.py, load_model_config)."""
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"distill.teacher_model_name_or_path={name_or_path}: cannot read a model config from it "
                          f"({error}); point it at a checkpoint written by save_pretrained, or a hub id") from None
    config.use_cache = False
    return config


@cache
def vocabularies(tokenizer_path: str, teacher_path: str) -> tuple[dict[str, int], dict[str, int]] | None:
    """The run's tokenizer's and the teacher's (token -> id), where the teacher's folder holds a tokenizer and the run's
    is local or in the cache; else None (the teacher is taken to number tokens as the run's tokenizer does)."""
    if not (Path(teacher_path) / "tokenizer_config.json").is_file():
        return None
    try:
        ours = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True).get_vocab()
    except (OSError, ValueError):
        return None
    return ours, AutoTokenizer.from_pretrained(teacher_path).get_vocab()


def teacher_ids(recipe: Recipe) -> tuple[int, ...] | None:
    """Where the teacher's tokenizer numbers the run's tokens otherwise (the same tokens, other ids): the teacher's id
    of each of the run's token ids, by which the loss reads the teacher (training/objectives/distill/teacher.py);
    None where it numbers them alike, or holds other tokens (which vocabulary.py refuses)."""
    both = vocabularies(recipe.tokenizer_path, recipe.distill.teacher_model_name_or_path)
    if both is None or both[0] == both[1] or both[0].keys() != both[1].keys():
        return None
    ours, theirs = both
    by_id = {index: token for token, index in ours.items()}
    return tuple(theirs[by_id[index]] for index in range(len(by_id)))


@cache
def teacher_shape(name_or_path: str, trust_remote_code: bool) -> ModelShape:
    return model_shape(teacher_config(name_or_path, trust_remote_code))


def teacher_bytes(recipe: Recipe, precision: Precision, stage: int, ranks: int) -> float:
    """The teacher per rank (training/objectives/distill/teacher.py): frozen, in the trained weights' dtype
    (weights_dtype: fp32 at ZeRO-0, where 16-bit precision is torch autocast), a full copy on each rank at ZeRO 0-2;
    at ZeRO-3 partitioned over the `ranks` ranks, and its head's weight whole on each, which the loss reads beside
    the student's (on the device, also where ZeRO-3 offloads the parameters); where it numbers the tokens otherwise
    (teacher_ids), its head's rows in the run's order, a copy at ZeRO 0-2 too."""
    shape = teacher_shape(recipe.distill.teacher_model_name_or_path, recipe.model.trust_remote_code)
    itemsize = weights_dtype(precision, stage).itemsize
    head = shape.vocab_size * shape.hidden_size * itemsize
    if stage != 3:
        return shape.parameters * itemsize + (head if teacher_ids(recipe) else 0.0)
    return shape.parameters * itemsize / ranks + head


def sampling_bytes(recipe: Recipe, precision: Precision, shape: ModelShape, stage: int, ranks: int) -> float:
    """A step's sampling (training/objectives/distill/on_policy.py) per rank, GRPO's generation rule
    (grpo/memory.py, generation) for the rank's rows at once, each a prompt as long as a row and max_new_tokens more
    (an upper bound), by the student (lmbda > 0) and by the teacher (seq_kd), the larger; 0 where none samples."""
    section = recipe.distill
    if not samples(section):
        return 0.0
    data = recipe.data.model_copy(update={"seq_len": recipe.data.seq_len + section.max_new_tokens})
    as_generation = recipe.model_copy(update={"grpo": sampling_section(section), "data": data})
    shapes = [shape] * (section.lmbda > 0) + [teacher_shape(section.teacher_model_name_or_path,
                                                            recipe.model.trust_remote_code)] * section.seq_kd
    return max(generation(as_generation, precision, sampler, stage, ranks).total for sampler in shapes)


def distill_memory(recipe: Recipe, precision: Precision, shape: ModelShape, stage: int, ranks: int) -> ObjectiveMemory:
    """What distill holds per rank beside the trained model at ZeRO `stage` over `ranks` ranks: its teacher, and
    between the steps what its sampling takes."""
    return ObjectiveMemory(reference=teacher_bytes(recipe, precision, stage, ranks),
                           generation=sampling_bytes(recipe, precision, shape, stage, ranks))
