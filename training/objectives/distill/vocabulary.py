"""Whether the teacher scores the student's tokens, checked before anything is built. The divergence compares the two
next-token distributions entry by entry, so the teacher's token ids must be the student's: its tokenizer (where its
folder holds one) the run's, token for token, and both heads at least as wide as the tokenizer. Heads of other
widths are the same vocabulary padded (Qwen2.5's 0.5B and 7B: 151,936 and 152,064 rows for 151,665 tokens): the
loss reads the first rows of each, as many as the narrower has (loss.py), whose extra rows are no tokens. A teacher
whose tokenizer numbers the tokens otherwise is refused: its ids would need a mapping, which is not built."""
from pathlib import Path

from transformers import AutoTokenizer, PretrainedConfig

from training.base.errors import ConfigError
from training.config.recipe import Recipe
from training.models.model import load_tokenizer
from training.objectives.distill.memory import teacher_config

SETTING = "distill.teacher_model_name_or_path"


def check_vocabulary(recipe: Recipe, student: PretrainedConfig) -> None:
    path = recipe.distill.teacher_model_name_or_path
    teacher = teacher_config(path, recipe.model.trust_remote_code)
    tokenizer = load_tokenizer(recipe.tokenizer_path, recipe.model.trust_remote_code, cached_only=True)
    if tokenizer is not None and (Path(path) / "tokenizer_config.json").is_file():
        check_same_tokens(tokenizer.get_vocab(), AutoTokenizer.from_pretrained(path).get_vocab(), recipe, path)
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
    """The teacher's tokenizer numbers every token as the run's does."""
    differ = sorted(token for token in ours.keys() | theirs.keys() if ours.get(token) != theirs.get(token))
    if differ:
        token = differ[0]
        raise ConfigError(f"{SETTING}={path}: its tokenizer numbers {len(differ)} tokens otherwise than the run's "
                          f"({recipe.tokenizer_path}), e.g. {token!r}: {ours.get(token)} here, {theirs.get(token)} "
                          f"there; the divergence compares the two models' distributions token id by token id: use a "
                          f"teacher trained with the student's tokenizer")
