"""Whether the teacher scores the student's tokens, checked before anything is built. The divergence compares the two
next-token distributions entry by entry: the teacher's tokenizer (where its folder holds one) must hold the run's
tokens, no more and no fewer, and both heads must be at least as wide as the tokenizer. The same tokens numbered
otherwise are read through a mapping (memory.py's teacher_ids: the teacher's inputs and its head's rows in the run's
order, teacher.py). Heads of other widths are the same vocabulary padded (Qwen2.5's 0.5B and 7B: 151,936 and 152,064
rows for 151,665 tokens): the loss reads the first rows of each, as many as the narrower has (loss.py), whose extra
rows are no tokens. A teacher of other tokens is refused: the two distributions would be over different
vocabularies (TRL's GOLD and ULD losses are for that, not built)."""
from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.config.recipe import Recipe
from training.models.model import load_tokenizer
from training.objectives.distill.memory import teacher_config, vocabularies

SETTING = "distill.teacher_model_name_or_path"


def check_vocabulary(recipe: Recipe, student: PretrainedConfig) -> None:
    path = recipe.distill.teacher_model_name_or_path
    teacher = teacher_config(path, recipe.model.trust_remote_code)
    tokenizer = load_tokenizer(recipe.tokenizer_path, recipe.model.trust_remote_code, cached_only=True)
    if both := vocabularies(recipe.tokenizer_path, path):
        check_same_tokens(*both, recipe, path)
    width = min(student.vocab_size, teacher.vocab_size)
    if tokenizer is None and student.vocab_size != teacher.vocab_size:
        raise ConfigError(f"{SETTING}={path}: its vocabulary has {teacher.vocab_size} entries, the student's "
                          f"{student.vocab_size}, and the tokenizer ({recipe.tokenizer_path}) is not in the local "
                          f"cache to say whether they are one padded: download it first")
    if tokenizer is not None and len(tokenizer) > width:
        raise ConfigError(f"{SETTING}={path}: the tokenizer ({recipe.tokenizer_path}) has {len(tokenizer)} tokens, but "
                          f"the {'teacher' if teacher.vocab_size == width else 'student'}'s head has {width} "
                          f"entries: the teacher must score every token of the student's vocabulary; use a teacher "
                          f"of the student's tokenizer")


def check_same_tokens(ours: dict[str, int], theirs: dict[str, int], recipe: Recipe, path: str) -> None:
    """The teacher's tokenizer holds the run's tokens, no more and no fewer (numbered alike, or otherwise: then the
    loss reads the teacher through the mapping, memory.py's teacher_ids)."""
    differ = sorted(ours.keys() ^ theirs.keys())
    if differ:
        token = differ[0]
        raise ConfigError(f"{SETTING}={path}: its tokenizer holds {len(differ)} tokens the run's "
                          f"({recipe.tokenizer_path}) does not, or lacks them, e.g. {token!r} (id {ours.get(token)} "
                          f"here, {theirs.get(token)} there); the divergence compares the two models' distributions "
                          f"token by token, which needs one vocabulary: use a teacher of the student's tokens")
