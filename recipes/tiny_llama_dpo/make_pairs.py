"""Build an offline DPO preference data set from the tiny_llama_sft chat data.

Each conversation in ``../tiny_llama_sft/chat.jsonl`` becomes one pair in TRL's
standard conversational preference form:

* ``prompt``   -- the messages up to and including the last user turn
                  (the system turn, if any, is kept);
* ``chosen``   -- the conversation's real last assistant reply;
* ``rejected`` -- the last assistant reply of another conversation, drawn at
                  random among those with a different ``source`` (pydoc topic),
                  excluding texts that are also a real reply of the prompt's source;
* ``source``   -- the original source string.

Why this is a fair preference signal: the chosen reply is the documentation
text that actually answers the prompt, while the rejected reply is equally
fluent, in-domain documentation text of the same style and length
distribution, but about a different topic. The only systematic difference
between the two is therefore whether the reply is relevant to the question,
so a model trained with DPO on these pairs learns to prefer on-topic answers
rather than surface features such as style or length.

The output is deterministic (fixed seed) and keeps the input order.
Conversations whose last turn is not an assistant reply are skipped.
Only ``pairs.jsonl`` beside this script is written.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "tiny_llama_sft" / "chat.jsonl"
OUT = HERE / "pairs.jsonl"
SEED = 1234

Message = dict[str, str]


def load(path: Path) -> list[dict[str, Any]]:
    """Read the conversations, keeping only those that end with an assistant reply."""
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["messages"] and r["messages"][-1]["role"] == "assistant"]


def split(messages: list[Message]) -> tuple[list[Message], str]:
    """Return (messages up to and including the last user turn, last assistant reply)."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: last_user + 1], messages[-1]["content"]


def make_pairs(rows: list[dict[str, Any]], seed: int = SEED) -> list[dict[str, Any]]:
    """Pair each conversation's real reply with a random reply from another source."""
    rng = random.Random(seed)
    replies = [r["messages"][-1]["content"] for r in rows]
    # Some pydoc topics share passages, so also track every reply text of a source:
    # a "rejected" reply must never be a genuine answer for the prompt's own source.
    own: dict[str, set[str]] = defaultdict(set)
    for row, reply in zip(rows, replies):
        own[row["source"]].add(reply)
    pairs = []
    for row, chosen in zip(rows, replies):
        prompt, _ = split(row["messages"])
        # Rejection sampling: retry until the other conversation has a different
        # source and its reply is not one of this source's own replies.
        while True:
            j = rng.randrange(len(rows))
            if rows[j]["source"] != row["source"] and replies[j] not in own[row["source"]]:
                break
        pairs.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": replies[j]}],
                "source": row["source"],
            }
        )
    return pairs


def main() -> None:
    pairs = make_pairs(load(SRC))
    with OUT.open("w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair, ensure_ascii=False) + "\n")
    print(f"wrote {len(pairs)} pairs to {OUT}")


if __name__ == "__main__":
    main()
