"""Writes prompts.jsonl: 2,000 sums of two numbers under 50 ("17+25="), each with its `answer` ("42"), for
tiny_llama_grpo. Seeded, so the file is the same on every run: python recipes/tiny_llama_grpo/make_prompts.py"""
import json
import random
from pathlib import Path


def main() -> None:
    rng = random.Random(1234)
    pairs = [(a, b) for a in range(50) for b in range(50)]
    rng.shuffle(pairs)
    pairs = pairs[:2000]
    lines = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a, b in pairs]
    (Path(__file__).parent / "prompts.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
