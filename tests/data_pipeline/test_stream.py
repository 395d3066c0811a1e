import json

import numpy as np
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from data_pipeline.config import DataConfig
from data_pipeline.pack import pack_concat
from data_pipeline.stream import StreamingBatches, split_lengths
from training.base.errors import ConfigError
from training.config.recipe import RECIPES_DIR, load_recipe

CORPUS = RECIPES_DIR / "tiny_llama" / "corpus.jsonl"
TOKENIZER = AutoTokenizer.from_pretrained(RECIPES_DIR / "tiny_llama" / "tokenizer")


def streaming_config(**data) -> DataConfig:
    return DataConfig(**{"sources": [{"path": str(CORPUS)}], "seq_len": 64, "streaming": True, "shuffle_buffer": 0,
                         "dedup": {"exact": False}, **data})


def rows_of(batches: StreamingBatches, steps: range) -> dict[str, np.ndarray]:
    micro = [m for step in steps for m in batches.micro_batches(step)]
    return {name: np.concatenate([m[name].numpy() for m in micro]) for name in micro[0]}


def test_split_lengths():
    head, tail = split_lengths(np.array([3, 5, 2]), 6)
    assert head.tolist() == [3, 3] and tail.tolist() == [2, 2]
    head, tail = split_lengths(np.array([3, 5]), 8)
    assert head.tolist() == [3, 5] and tail.tolist() == []


def test_in_order_stream_gives_the_rows_of_concat_packing():
    texts = [json.loads(line)["text"] for line in CORPUS.open()][:60]
    documents = [ids + [TOKENIZER.eos_token_id] for ids in TOKENIZER(texts).input_ids]
    expected = pack_concat(np.concatenate(documents), np.array([len(d) for d in documents]), 64)
    rows = rows_of(StreamingBatches(streaming_config(), TOKENIZER, 4, 2, 0, 1, seed=0), range(3))
    for name in ("input_ids", "labels", "position_ids", "length"):
        np.testing.assert_array_equal(rows[name], expected[name][:24])


def test_resume_continues_exactly_where_the_stream_stopped():
    batches = StreamingBatches(streaming_config(), TOKENIZER, 4, 2, 0, 1, seed=0)
    rows_of(batches, range(5))
    state = batches.state_dict()
    expected = rows_of(batches, range(5, 8))
    resumed = StreamingBatches(streaming_config(), TOKENIZER, 4, 2, 0, 1, seed=0)
    resumed.load_state_dict(state)
    for name, array in rows_of(resumed, range(5, 8)).items():
        np.testing.assert_array_equal(array, expected[name])


@pytest.mark.parametrize("shuffle_buffer", [0, 100])
def test_ranks_read_disjoint_shares_that_cover_the_stream(shuffle_buffer):
    """Of one source file (one shard, too few to give each rank whole shards), `datasets` gives rank r of 2 the
    documents r, r + 2, r + 4, ... of the single-rank stream, shuffled or not (every rank shuffles with the same
    seed, then keeps its every other document): the shares are disjoint and together cover the single-rank
    stream's first 40 documents, in order. Each rank packs its own share with concat, as one rank packs the
    whole stream."""
    from data_pipeline.sources import load_source
    from data_pipeline.stream import stream_documents
    config = streaming_config(shuffle_buffer=shuffle_buffer)
    assert load_source(config.sources[0], 0, streaming=True).num_shards == 1
    whole = [d["text"] for d, _ in zip(stream_documents(config, TOKENIZER, 0, 1, seed=0), range(40))]
    shares = [[d["text"] for d, _ in zip(stream_documents(config, TOKENIZER, rank, 2, seed=0), range(20))]
              for rank in range(2)]
    assert shares == [whole[0::2], whole[1::2]]
    if shuffle_buffer:  # the shuffle reorders the documents (else this case would repeat the unshuffled one)
        in_order = [d["text"] for d, _ in zip(stream_documents(streaming_config(), TOKENIZER, 0, 1, seed=0), range(40))]
        assert whole != in_order
    for rank, share in enumerate(shares):
        documents = [ids + [TOKENIZER.eos_token_id] for ids in TOKENIZER(share).input_ids]
        expected = pack_concat(np.concatenate(documents), np.array([len(d) for d in documents]), 64)
        rows = rows_of(StreamingBatches(config, TOKENIZER, 2, 1, rank, 2, seed=0), range(2))
        assert len(expected["input_ids"]) >= 4  # the 20 documents fill the 4 rows read
        for name in ("input_ids", "labels", "position_ids", "length"):
            np.testing.assert_array_equal(rows[name], expected[name][:4])


def test_the_stream_starts_a_new_epoch_when_it_runs_out():
    batches = StreamingBatches(streaming_config(seq_len=1024), TOKENIZER, 8, 4, 0, 1, seed=0)
    rows_of(batches, range(12))  # 12 x 32 rows x 1024 tokens > the 306k-token corpus
    assert batches.epoch == 1


def test_shuffled_streams_depend_on_the_seed():
    a, b = (rows_of(StreamingBatches(streaming_config(shuffle_buffer=100), TOKENIZER, 2, 1, 0, 1, seed=s), range(1))
            for s in (1, 2))
    assert not np.array_equal(a["input_ids"], b["input_ids"])


@pytest.mark.parametrize("data, message", [
    ({"dedup": {"exact": True}}, "data.streaming does not support dedup.exact"),
    ({"packing": "bfd"}, "does not support packing other than concat"),
    ({"eval": {"fraction": 0.1}}, "does not support eval"),
])
def test_what_streaming_cannot_do_is_refused(data, message):
    with pytest.raises(ValidationError, match=message):
        streaming_config(**data)


def test_streaming_needs_max_steps():
    with pytest.raises(ConfigError, match="data.streaming needs training.max_steps"):
        load_recipe("tiny_llama", ["data.streaming=true", "data.dedup.exact=false", "training.max_steps=null",
                                   "training.epochs=1"])


FILTERS = [{"type": "c4"}, {"type": "gopher_repetition"}]


@pytest.mark.slow
def test_a_filtered_stream_reads_the_documents_the_filters_keep_and_resumes_exactly():
    """The stream's documents are those (with C4's edits) the in-process path keeps; resume continues exactly."""
    from data_pipeline.prepare import filter_documents
    from data_pipeline.sources import load_documents
    config = streaming_config(filters=FILTERS)
    kept, _ = filter_documents(load_documents(config.sources).select(range(400)), config, TOKENIZER, {})
    documents = [ids + [TOKENIZER.eos_token_id] for ids in TOKENIZER(kept["text"][:40]).input_ids]
    expected = pack_concat(np.concatenate(documents), np.array([len(d) for d in documents]), 64)
    batches = StreamingBatches(config, TOKENIZER, 4, 2, 0, 1, seed=0)
    rows = rows_of(batches, range(3))
    np.testing.assert_array_equal(rows["input_ids"], expected["input_ids"][:24])
    state = batches.state_dict()
    following = rows_of(batches, range(3, 6))
    resumed = StreamingBatches(config, TOKENIZER, 4, 2, 0, 1, seed=0)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(rows_of(resumed, range(3, 6))["input_ids"], following["input_ids"])
