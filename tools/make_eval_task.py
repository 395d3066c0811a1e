"""Build eval_tasks/python_docs_mc/questions.jsonl: multiple-choice sentence endings from the shipped Python
documentation (recipes/tiny_llama/corpus.jsonl), a benchmark that needs no network.

    python tools/make_eval_task.py            # rewrites the questions (the same ones: seeded)

Each question is the first part of a prose sentence of the documentation; the choices are its true ending and the
endings of three other sentences of about the same length, in a seeded order. tiny_llama trains on the same
documents, so the task measures how much of the corpus a run has learned (a smoke benchmark, not a held-out one).
"""
import json
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "recipes/tiny_llama/corpus.jsonl"
OUT = REPO / "eval_tasks/python_docs_mc/questions.jsonl"
QUESTIONS, CHOICES, SEED = 200, 4, 0


def prose_sentences(text: str) -> list[str]:
    """Sentences of 10 to 30 words from the text's prose paragraphs (no code, tables, headings or lists)."""
    sentences = []
    for paragraph in text.split("\n\n"):
        if paragraph.startswith((" ", "*", "-", "=", ">>>")) or "::" in paragraph or "|" in paragraph:
            continue
        for sentence in re.split(r"(?<=\.)\s+", " ".join(paragraph.split())):
            words = sentence.split()
            if 10 <= len(words) <= 30 and sentence.endswith(".") and sentence[0].isupper() and '"' not in sentence:
                sentences.append(sentence)
    return sentences


def main() -> int:
    rng = random.Random(SEED)
    sentences = sorted({s for line in CORPUS.open() for s in prose_sentences(json.loads(line)["text"])})
    rng.shuffle(sentences)
    splits = []
    for sentence in sentences:
        words = sentence.split()
        cut = len(words) * 3 // 5
        splits.append((" ".join(words[:cut]), " " + " ".join(words[cut:])))
    questions = []
    for index, (context, ending) in enumerate(splits[:QUESTIONS]):
        length = len(ending.split())
        others = [other for _, other in splits[QUESTIONS:] if abs(len(other.split()) - length) <= 2 and other != ending]
        choices = [ending, *rng.sample(others, CHOICES - 1)]
        rng.shuffle(choices)
        questions.append({"id": index, "context": context, "choices": choices, "answer": choices.index(ending)})
    OUT.write_text("".join(json.dumps(question) + "\n" for question in questions))
    print(f"{len(questions)} questions from {len(sentences)} sentences -> {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
