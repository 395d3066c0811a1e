"""Rebuild the offline assets of the `tiny_llama` recipes: the corpus, the tokenizer and the chat data.

The corpus is English prose every CPython install carries: the language reference topics
behind `help()` (pydoc_data.topics) and the docstrings of the standard library. The output
depends on the Python version, so the files are committed and this script only documents
(and can redo) how they were made:

    python tools/make_tiny_assets.py   # writes recipes/tiny_llama/{corpus.jsonl,tokenizer/}
                                       # and recipes/tiny_llama_sft/chat.jsonl

The chat data is made from the corpus: questions about a documented name or topic, answered with
its documentation's opening paragraphs, some with a follow-up turn.
"""
import contextlib
import importlib
import inspect
import io
import json
import re
import sys
import warnings
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes" / "tiny_llama"
SFT_RECIPE_DIR = RECIPE_DIR.parent / "tiny_llama_sft"
QUESTIONS = ["What does {} do?", "Explain {}.", "How is {} used?", "Tell me about {}."]
SYSTEM = "You answer questions about Python from its documentation."
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "test",
                   "ensurepip", "venv", "pydoc_data"}
MIN_DOC_CHARS = 80
# Llama-2-like turns: <s>role, newline, content</s>; the model learns to end its replies with </s>.
CHAT_TEMPLATE = ("{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def reference_topics() -> list[dict]:
    """Each `help()` topic, split at its section headings into documents of a few KB."""
    from pydoc_data.topics import topics
    docs = []
    for name, text in sorted(topics.items()):
        sections = re.split(r"\n(?=[^\n]+\n[*=\-]{4,}\n)", text)
        docs += [{"text": s.strip(), "source": f"pydoc:{name}"} for s in sections if len(s.strip()) >= MIN_DOC_CHARS]
    return docs


def stdlib_docstrings() -> list[dict]:
    """Docstrings of public standard-library modules, classes, functions and methods."""
    docs, seen = [], set()

    def add(obj, where: str) -> None:
        text = inspect.getdoc(obj)
        if text and len(text) >= MIN_DOC_CHARS and id(obj) not in seen:
            seen.add(id(obj))
            docs.append({"text": text, "source": f"docstring:{where}"})

    warnings.filterwarnings("ignore")
    for name in sorted(sys.stdlib_module_names):
        if name in SKIPPED_MODULES or name.startswith("_"):
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                module = importlib.import_module(name)
        except Exception:
            continue
        add(module, name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                add(obj, f"{name}.{attr}")
            if inspect.isclass(obj):
                for method, fn in sorted(vars(obj).items()):
                    if not method.startswith("_") and inspect.isfunction(fn):
                        add(fn, f"{name}.{attr}.{method}")
    return docs


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (no unknown bytes) that prepends <s> like Llama's tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", bos)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>", pad_token="<pad>", model_max_length=1024)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def conversation(doc: dict, index: int) -> dict | None:
    """A chat about one document: its name asked about, its first paragraph the answer; every third
    has a system prompt, every second a follow-up turn with the next paragraph."""
    kind, _, name = doc["source"].partition(":")
    paragraphs = [p.strip() for p in doc["text"].split("\n\n")
                  if len(p.strip()) >= 40 and not re.search(r"^[*=\-]{4,}$", p, re.MULTILINE)]  # no headings
    if len(paragraphs) < 1 + index % 2:
        return None
    question = (QUESTIONS[index % len(QUESTIONS)].format(f"`{name}`") if kind == "docstring"
                else f"What does the language reference say about {name}?")
    messages = [{"role": "system", "content": SYSTEM}] if index % 3 == 0 else []
    messages += [{"role": "user", "content": question},
                 {"role": "assistant", "content": paragraphs[0][:600]}]
    if index % 2:
        messages += [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": paragraphs[1][:600]}]
    return {"messages": messages, "source": doc["source"]}


def main() -> None:
    docs = reference_topics() + stdlib_docstrings()
    with open(RECIPE_DIR / "corpus.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    train_tokenizer([d["text"] for d in docs]).save_pretrained(RECIPE_DIR / "tokenizer")
    chats = [c for c in (conversation(doc, i) for i, doc in enumerate(docs)) if c]
    with open(SFT_RECIPE_DIR / "chat.jsonl", "w") as f:
        for chat in chats:
            f.write(json.dumps(chat) + "\n")
    print(f"{len(chats)} conversations -> {SFT_RECIPE_DIR}")
    print(f"{len(docs)} documents, {sum(len(d['text']) for d in docs) / 1e6:.2f} MB of text -> {RECIPE_DIR}")


if __name__ == "__main__":
    main()
