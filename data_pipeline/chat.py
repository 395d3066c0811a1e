"""Chat SFT samples: render with the tokenizer's chat template, take loss only on the assistant turns."""
from transformers import PreTrainedTokenizerBase

from training.base.errors import DataError

IGNORE_INDEX = -100


def assistant_spans(messages: list[dict], tokenizer: PreTrainedTokenizerBase) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant replies.

    A reply's span runs from the end of the conversation rendered up to it with the generation prompt
    (e.g. "<|im_start|>assistant\\n") to the end of the conversation rendered with it, so it holds the
    reply and whatever the template puts after it (e.g. the end-of-turn token the model must learn to
    emit). This works for any template that renders a conversation as the concatenation of its turns,
    and it is checked: a template that does not is an error, not a silently wrong mask.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True)
        with_reply = tokenizer.apply_chat_template(messages[:turn + 1], tokenize=False)
        if not (with_reply.startswith(prompt) and text.startswith(with_reply)):
            raise DataError("the tokenizer's chat template does not render a conversation as the concatenation "
                            "of its turns, so the assistant replies cannot be located; use a tokenizer whose "
                            "template does (tokenizer.name_or_path)")
        spans.append((len(prompt), len(with_reply)))
    return text, spans


def render_chat(messages: list[dict], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]] | None:
    """Token ids and labels (-100 except on assistant replies), or None for a conversation with no
    assistant reply (nothing to learn from it). A token belongs to a reply when it starts inside it."""
    text, spans = assistant_spans(messages, tokenizer)
    if not spans:
        return None
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, labels, span = encoded["input_ids"], [], 0
    for token, (start, _) in zip(ids, encoded["offset_mapping"]):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        labels.append(token if span < len(spans) and start >= spans[span][0] else IGNORE_INDEX)
    return ids, labels
