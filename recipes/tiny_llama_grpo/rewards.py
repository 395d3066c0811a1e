"""tiny_llama_grpo's own reward, named in its recipe as `rewards:digits` (this folder is on the path): TRL's signature,
so it would work unchanged in TRL's GRPOTrainer."""


def digits(prompts: list, completions: list, **row_fields) -> list[float]:
    """The share of the completion's characters that are digits, before its first space or line: dense, so that a
    model that has never answered a sum learns first to answer with a number (exact_answer then rewards the right
    one)."""
    rewards = []
    for completion in completions:
        answer = completion.strip().split()[0] if completion.strip() else ""
        rewards.append(sum(c.isdigit() for c in answer) / max(len(answer), 1) if answer else 0.0)
    return rewards
