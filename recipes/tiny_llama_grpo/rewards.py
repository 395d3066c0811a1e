"""tiny_llama_grpo's own reward, named in its recipe as `rewards:closeness` (this folder is on the path): TRL's
signature, so it works unchanged in TRL's GRPOTrainer."""
import re


def closeness(prompts: list, completions: list, answer: list[str], **row_fields) -> list[float]:
    """How near the completion's first number is to the answer: 1 - |number - answer| / answer, at least 0; 0 without
    a number. Dense, so that a model that has never answered a sum learns first to answer with a number, then with
    one near the sum (exact_answer rewards the right one)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        found = re.match(r"\s*(\d+)", completion)
        target = int(expected)
        rewards.append(max(0.0, 1 - abs(int(found[1]) - target) / max(target, 1)) if found else 0.0)
    return rewards
