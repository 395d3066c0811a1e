"""Preference pairs: read (TRL's forms, errors naming the row and field), tokenized, prepared, and packed with every
sequence whole, apart from the others, and its loss on the completion only."""
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from data_pipeline.config import DataConfig
from data_pipeline.preference import implicit_prompt, load_pairs, pack_pairs, tokenize_pair
from data_pipeline.prepare import build_dataset
from tests.conftest import REPO
from training.base.errors import DataError

TOKENIZER = REPO / "recipes/tiny_llama/tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def chat_pair(question: str, good: str, bad: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}]}


@pytest.mark.parametrize("packing", ["bfd", "none"])
def test_packed_pairs_keep_every_sequence_whole_and_apart(packing):
    rng = np.random.default_rng(0)
    pairs = 7
    chosen = [rng.integers(3, 100, rng.integers(4, 40)) for _ in range(pairs)]
    rejected = [rng.integers(3, 100, rng.integers(4, 40)) for _ in range(pairs)]
    prompts = np.array([rng.integers(1, min(len(c), len(r))) for c, r in zip(chosen, rejected)])
    batch = pack_pairs(chosen, rejected, prompts, 48, 0, packing)
    assert batch["pairs"] == pairs and batch["input_ids"].shape[1] == 48
    assert len(batch["input_ids"]) <= 2 * pairs if packing == "bfd" else len(batch["input_ids"]) == 2 * pairs
    for index, sequence in enumerate(s for pair in zip(chosen, rejected) for s in pair):
        where = batch["sequence_index"] == index
        assert where.sum(dim=1).max() == len(sequence)  # in one row, whole
        assert batch["input_ids"][where].tolist() == sequence.tolist()
        assert batch["position_ids"][where].tolist() == list(range(len(sequence)))
        prompt = prompts[index // 2]
        labels = batch["labels"][where].tolist()
        assert labels[:prompt] == [-100] * prompt and labels[prompt:] == sequence[prompt:].tolist()
    padding = batch["sequence_index"] == -1
    assert (batch["labels"][padding] == -100).all()
    assert batch["length"].sum() == sum(map(len, chosen + rejected))


def test_string_pairs_end_in_one_eos_and_the_loss_starts_after_the_prompt(tokenizer):
    chosen, rejected, prompt_length = tokenize_pair("What is a list?", " A sequence.", " A fish" + tokenizer.eos_token,
                                                    tokenizer)
    prompt = tokenizer("What is a list?")["input_ids"]
    assert chosen[:prompt_length] == prompt == rejected[:prompt_length] and chosen[0] == tokenizer.bos_token_id
    assert chosen[-1] == rejected[-1] == tokenizer.eos_token_id and rejected[-2] != tokenizer.eos_token_id


def test_chat_pairs_use_the_template_with_the_generation_prompt(tokenizer):
    pair = chat_pair("What is a dict?", "A mapping.", "A fish.")
    chosen, rejected, prompt_length = tokenize_pair(pair["prompt"], pair["chosen"], pair["rejected"], tokenizer)
    rendered = tokenizer.apply_chat_template(pair["prompt"] + pair["chosen"], tokenize=False)
    assert tokenizer.decode(chosen) == rendered
    assert tokenizer.decode(chosen[prompt_length:]).startswith("A mapping.")


def test_an_implicit_prompt_is_the_conversations_shared_start():
    user = {"role": "user", "content": "Hi?"}
    good, bad = {"role": "assistant", "content": "Hello."}, {"role": "assistant", "content": "Go away."}
    assert implicit_prompt([user, good], [user, bad]) == ([user], [good], [bad])


def test_ultrafeedback_layout_a_string_prompt_beside_full_conversations(tmp_path):
    """UltraFeedback binarized: `prompt` a string, chosen/rejected whole conversations (TRL extracts the prompt)."""
    user = {"role": "user", "content": "Hi?"}
    path = write_jsonl(tmp_path / "uf.jsonl", [{"prompt": "Hi?",
                                                "chosen": [user, {"role": "assistant", "content": "Hello."}],
                                                "rejected": [user, {"role": "assistant", "content": "No."}]}])
    pair = load_pairs(DataConfig(sources=[{"path": path}], seq_len=64, examples="pairs").sources)[0]
    assert json.loads(pair["prompt"]) == [user] and json.loads(pair["chosen"])[0]["content"] == "Hello."


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Q", "chosen": 3, "rejected": "B"}, "row 2: field 'chosen' holds int"),
    ({"prompt": "Q", "chosen": "A", "rejected": [{"role": "assistant", "content": "B"}]}, "row 2: one of 'chosen'"),
    ({"prompt": [{"role": "user", "content": "Q"}], "chosen": "A", "rejected": "B"}, "row 2: field 'prompt'"),
    ({"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": ""}],
      "rejected": [{"role": "assistant", "content": "B"}]}, "row 2: field 'chosen' holds an empty reply"),
    ({"chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": " \n"}],
      "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}]},
     "row 2: field 'chosen' holds an empty reply"),  # TRL's implicit prompt: the reply after the shared turns
    ({"prompt": "Q", "chosen": "A", "rejected": "  "}, "row 2: field 'rejected' holds an empty reply"),
])
def test_a_bad_pair_is_named_by_row_and_field(tmp_path, row, message):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q", "chosen": "A", "rejected": "B"}, row])
    with pytest.raises(DataError, match=f"{path}: {message}"):
        load_pairs(DataConfig(sources=[{"path": path}], seq_len=64, examples="pairs").sources)


def test_a_pairs_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b'{"prompt": "Q", "chosen": "A", "rejected": "B"}\n{"prompt": "caf\xe9", "chosen": "A", '
                     b'"rejected": "B"}\n')
    with pytest.raises(DataError, match=f"{path}:2: not UTF-8 .*convert the file to UTF-8"):
        load_pairs(DataConfig(sources=[{"path": str(path)}], seq_len=64, examples="pairs").sources)


@pytest.mark.parametrize("role", ["assistent", "user"])
def test_a_chat_reply_in_another_role_than_assistant_is_refused_with_its_row(tmp_path, role):
    """Before: the template rendered the reply's turn under another header than the prompt's generation prompt, so
    the 'completion' began inside the role name and DPO trained at 100% accuracy on it."""
    rows = [chat_pair("Q1", "good", "bad"), chat_pair("Q2", "good", "bad")]
    rows[1]["rejected"][0]["role"] = role
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError, match=f"pairs.jsonl: row 2: field 'rejected' ends in a '{role}' turn, not the "
                                        f"'assistant' reply"):
        load_pairs(DataConfig(sources=[{"path": path}], seq_len=64, examples="pairs").sources)


def test_pairs_with_nothing_to_prefer_are_refused_and_some_are_counted(tmp_path, capsys):
    same = [{"prompt": f"Q{i}", "chosen": " A", "rejected": " A"} for i in range(3)]
    config = DataConfig(sources=[{"path": write_jsonl(tmp_path / "same.jsonl", same)}], seq_len=64, examples="pairs")
    with pytest.raises(DataError, match=r"in every pair \(3\) the chosen reply equals the rejected one"):
        load_pairs(config.sources)
    mixed = [*same, {"prompt": "Q", "chosen": " A", "rejected": " B"}]
    config = DataConfig(sources=[{"path": write_jsonl(tmp_path / "mixed.jsonl", mixed)}], seq_len=64, examples="pairs")
    assert len(load_pairs(config.sources)) == 4
    assert capsys.readouterr().err.count("3 of 4 pairs have the same chosen and rejected reply") == 1


def test_a_missing_field_names_the_setting(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q", "good": "A", "rejected": "B"}])
    with pytest.raises(DataError, match="no field 'chosen'.*set chosen_field"):
        load_pairs(DataConfig(sources=[{"path": path}], seq_len=64, examples="pairs").sources)


@pytest.mark.parametrize("policy, kept, counted", [("truncate", 4, "long_documents_truncated"),
                                                    ("drop", 3, "long_documents_dropped")])
def test_prepared_pairs_are_deduplicated_and_fitted_to_seq_len(tmp_path, tokenizer, policy, kept, counted):
    rows = [{"prompt": f"Question {i}?", "chosen": f" Answer {i}.", "rejected": f" Not {i}."} for i in range(4)]
    rows += [rows[1], {"prompt": "Q" * 400, "chosen": " A", "rejected": " B"}]  # a duplicate; a prompt over seq_len
    rows[2]["chosen"] = " word" * 100  # longer than seq_len, its prompt within
    config = DataConfig(sources=[{"path": write_jsonl(tmp_path / "pairs.jsonl", rows)}], seq_len=48, examples="pairs",
                        long_documents=policy, cache_dir=str(tmp_path / "cache"))
    prepared, stats, _ = build_dataset(config, tokenizer)
    train = prepared["train"]
    assert stats["exact_duplicates_removed"] == 1 and stats["pairs"] == len(train) == kept
    assert stats["documents_in"] == stats["sources"][0]["documents_in"] == 6
    assert stats[counted] == (1 if policy == "truncate" else 2) and stats["long_documents_dropped"] >= 1
    assert max(max(map(len, train["chosen_ids"])), max(map(len, train["rejected_ids"]))) <= 48
    assert all(p < min(len(c), len(r)) for p, c, r in zip(train["prompt_length"], train["chosen_ids"],
                                                          train["rejected_ids"]))


@pytest.mark.parametrize("policy, fix", [("truncate", "raise data.seq_len: under truncate a pair is dropped only "
                                                     "when its prompt alone fills seq_len"),
                                         ("drop", "raise data.seq_len or set data.long_documents=truncate")])
def test_pairs_that_all_go_name_the_fix_the_policy_leaves(tmp_path, tokenizer, policy, fix):
    """Every prompt fills seq_len: truncate cannot keep them, so it is not offered where it is already set."""
    rows = [{"prompt": f"Q{i} " * 60, "chosen": " A", "rejected": " B"} for i in range(3)]
    config = DataConfig(sources=[{"path": write_jsonl(tmp_path / "pairs.jsonl", rows)}], seq_len=48, examples="pairs",
                        long_documents=policy, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="no pairs are left after fitting them to data.seq_len=48") as refused:
        build_dataset(config, tokenizer)
    assert fix in str(refused.value)


def test_prepared_pairs_are_refused_by_a_language_model_run(tmp_path, tokenizer):
    from data_pipeline.prepare import save_prepared
    from training.base.errors import ConfigError
    from training.config.recipe import load_recipe
    rows = [{"prompt": f"Question {i}?", "chosen": f" Answer {i}.", "rejected": f" Not {i}."} for i in range(4)]
    config = DataConfig(sources=[{"path": write_jsonl(tmp_path / "pairs.jsonl", rows)}], seq_len=48, examples="pairs")
    save_prepared(*build_dataset(config, tokenizer), tmp_path / "prepared")
    assert load_recipe("tiny_llama_dpo", [f"data.prepared={tmp_path / 'prepared'}", "data.sources=[]",
                                          "data.eval.fraction=0"]).data.prepared
    with pytest.raises(ConfigError, match="holds preference pairs, but training.objective is lm"):
        load_recipe("tiny_llama", [f"data.prepared={tmp_path / 'prepared'}", "data.sources=[]"])
