"""distill's checks before anything is built (the teacher's vocabulary, the data on-policy sampling needs), what the
plan counts of the teacher and of the sampling, and the sampled sequences: seeded by the rows, not by where they
land, and written into the rows as the data's completions are."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, save_small_checkpoint, train_in_process
from training.base.errors import ConfigError
from training.config.recipe import load_recipe, recipe_inputs
from training.models.model import load_model_config
from training.objectives.distill.memory import distill_memory, teacher_shape
from training.objectives.distill.objective import Distill
from training.objectives.distill.on_policy import prompt_end, replace_completion, sample_sequences
from training.objectives.distill.spec import DistillSection
from training.planning.shape import model_shape


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill")
    save_small_checkpoint(folder / "student")
    save_small_checkpoint(folder / "teacher", {"hidden_size": 96, "num_hidden_layers": 3, "head_dim": 24})
    return folder


def recipe(models, *overrides):
    return load_recipe("tiny_llama_sft", [f"model.name_or_path={models / 'student'}", "training.objective=distill",
                                          f"distill.teacher_model_name_or_path={models / 'teacher'}",
                                          "data.packing=none", *overrides])


def check(run):
    Distill.check(run, load_model_config(run.model))


def test_a_teacher_is_named():
    with pytest.raises(ConfigError, match="distill.teacher_model_name_or_path is not set"):
        load_recipe("tiny_llama_sft", ["model.name_or_path=/tmp", "training.objective=distill"])


@pytest.mark.parametrize("overrides, refusal", [
    (["data.packing=bfd"], "set data.packing=none"),
    ([f"data.sources=[{{path: {REPO / 'recipes/tiny_llama/corpus.jsonl'}, text_field: text}}]"],
     r"data.sources\[0\] holds documents"),
    (["distill.max_new_tokens=256"], "leaves no room for a prompt"),
])
def test_sampling_needs_chat_rows_of_one_conversation(models, overrides, refusal):
    with pytest.raises(ConfigError, match=refusal):
        recipe(models, *overrides)
    recipe(models, *overrides, "distill.lmbda=0")  # distilled on the data's tokens: every one of them runs


def test_a_teacher_of_another_tokenizer_or_a_narrower_head_is_refused(models, tmp_path):
    check(recipe(models))
    shutil.copytree(models / "teacher", tmp_path / "renumbered")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "renumbered")
    tokenizer.add_tokens(["<extra>"])  # one more id than the run's: the vocabularies differ
    tokenizer.save_pretrained(tmp_path / "renumbered")
    with pytest.raises(ConfigError, match="holds 1 tokens the run's .* does not, or lacks them, e.g. '<extra>'"):
        check(recipe(models, f"distill.teacher_model_name_or_path={tmp_path / 'renumbered'}"))
    save_small_checkpoint(tmp_path / "narrow", {"vocab_size": 1000})
    with pytest.raises(ConfigError, match="has 4096 tokens, but the teacher's head has 1000 entries"):
        check(recipe(models, f"distill.teacher_model_name_or_path={tmp_path / 'narrow'}"))


def renumbered(teacher: Path, folder: Path, swap: tuple[int, int] = (100, 200)) -> Path:
    """The teacher with two tokens' ids swapped: in its tokenizer, and in its embedding's and head's rows (the same
    model, its vocabulary numbered otherwise)."""
    model = AutoModelForCausalLM.from_pretrained(teacher)
    order = list(range(model.config.vocab_size))
    order[swap[0]], order[swap[1]] = swap[1], swap[0]
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weight.copy_(weight[order])
    model.save_pretrained(folder)
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {index: token for token, index in vocab.items()}
    vocab[by_id[swap[0]]], vocab[by_id[swap[1]]] = swap[1], swap[0]
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(teacher / name, folder / name)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_a_teacher_numbering_the_tokens_otherwise_is_read_in_the_runs_order(models, tmp_path):
    """The same teacher with two ids swapped: the check lets it in, the plan counts its head's rows copied in the run's
    order, and read through the mapping (its inputs in its numbering, its head's rows in the run's) it gives the
    original teacher's loss exactly."""
    from training.objectives.distill.loss import Logits, Teacher, distilling, target_mask
    from training.objectives.distill.memory import teacher_ids
    from training.objectives.distill.teacher import in_run_order
    other = renumbered(models / "teacher", tmp_path / "renumbered")
    run = recipe(models, f"distill.teacher_model_name_or_path={other}")
    check(run)
    ids = teacher_ids(run)
    assert teacher_ids(recipe(models)) is None and (ids[100], ids[200], ids[5]) == (200, 100, 5)
    shape = teacher_shape(str(other), False)
    student = model_shape(load_model_config(run.model))
    copied = shape.vocab_size * shape.hidden_size * 4
    assert (distill_memory(run, "fp32", student, 2, 1).reference
            == distill_memory(recipe(models), "fp32", student, 2, 1).reference + copied)
    with pytest.raises(ConfigError, match="seq_kd with a teacher that numbers the tokens otherwise"):
        check(recipe(models, f"distill.teacher_model_name_or_path={other}", "distill.seq_kd=true"))
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 4096, (2, 10)), "position_ids": torch.arange(10).repeat(2, 1)}
    batch["input_ids"][0, 3], batch["input_ids"][1, 4] = 100, 200
    labels = batch["input_ids"].clone()
    taken = target_mask(labels)
    losses = []
    for path, mapping in ((models / "teacher", None), (other, torch.tensor(ids))):
        student, teacher = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (models / "student", path))
        distilling(student)
        distilling(teacher)
        inputs = batch["input_ids"] if mapping is None else mapping[batch["input_ids"]]
        with torch.no_grad():
            hidden = teacher(input_ids=inputs, position_ids=batch["position_ids"], hidden_only=True)
            head = in_run_order(teacher.lm_head.weight, mapping, copy=False)
            states = Teacher(hidden.reshape(-1, hidden.shape[-1])[taken], head, Logits(), 0.5, 0.9, 0.0)
            losses.append(student(**batch, labels=labels, teacher=states).loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)


def test_the_teacher_is_an_input_no_output_may_hold(models):
    assert models / "teacher" in recipe_inputs(recipe(models))


def test_the_plan_counts_the_teacher_and_the_sampling(models):
    """The teacher in the run's weights' dtype (fp32 here), whole at ZeRO 0-2, partitioned at ZeRO-3 beside its
    head's weight whole; the sampling's generation only where sequences are sampled."""
    run = recipe(models)
    student, teacher = model_shape(load_model_config(run.model)), teacher_shape(str(models / "teacher"), False)
    for stage, ranks, expected in ((2, 4, teacher.parameters * 4),
                                   (3, 4, teacher.parameters * 4 / 4 + teacher.vocab_size * teacher.hidden_size * 4)):
        memory = distill_memory(run, "fp32", student, stage, ranks)
        assert memory.reference == expected and memory.generation > 0
    assert distill_memory(recipe(models, "distill.lmbda=0"), "fp32", student, 2, 4).generation == 0


def test_the_dry_run_shows_the_teacher_and_the_sampling(models, no_model_building):
    result = train_in_process(["--recipe", "tiny_llama_sft", f"model.name_or_path={models / 'student'}",
                               "training.objective=distill", f"distill.teacher_model_name_or_path={models / 'teacher'}",
                               "data.packing=none", "deepspeed.config=zero3", "training.global_batch_size=32",
                               "--num-gpus", "4", "--gpu-mem", "80", "--dry-run"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "distill: generalized JSD, beta 0.5" in result.stdout
    assert "teacher: " in result.stdout and "partitioned over the 4 ranks by ZeRO-3" in result.stdout
    assert "sampled: each conversation's completion with probability 0.5 the student's" in result.stdout


def test_the_recipe_plans_with_its_teacher(models, no_model_building):
    """tiny_llama_distill's plan, its teacher (tiny_llama's export, which a fresh checkout has not trained yet) in
    place: the student from config, the forward KL, no sampling over documents."""
    result = train_in_process(["--recipe", "tiny_llama_distill",
                               f"distill.teacher_model_name_or_path={models / 'teacher'}", "--dry-run"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "distill: forward KL(teacher || student) (beta 0) at temperature 1" in result.stdout
    assert "1,411,712 parameters" in result.stdout and "sampled:" not in result.stdout


def rows_of(count: int) -> dict:
    """Rows of one conversation each: a 3-token prompt, a 4-token completion (the targets), padding."""
    input_ids = torch.arange(10, 10 + count * 12).reshape(count, 12)
    labels = torch.full_like(input_ids, -100)
    labels[:, 3:7] = input_ids[:, 3:7]
    return {"input_ids": input_ids, "labels": labels, "length": torch.full((count,), 7),
            "position_ids": torch.arange(12).repeat(count, 1)}


def test_a_sample_takes_the_completions_place_and_its_tokens_are_the_targets():
    batch = rows_of(2)
    assert prompt_end(batch["labels"][0], 7) == 3
    replace_completion(batch, 1, 3, torch.tensor([5, 6]), pad_id=0)
    assert batch["input_ids"][1].tolist()[:6] == [22, 23, 24, 5, 6, 0] and int(batch["length"][1]) == 5
    assert batch["labels"][1].tolist()[:6] == [-100, -100, -100, 5, 6, -100]
    replace_completion(batch, 0, 3, torch.arange(100, 120), pad_id=0)  # cut at the row's width
    assert batch["input_ids"][0, 3:].tolist() == list(range(100, 109)) and int(batch["length"][0]) == 12


def test_the_samples_follow_the_rows_not_the_layout(monkeypatch):
    """The same rows split over 1 or 2 micro-batches (1 or 2 ranks, any accumulation) draw the same samplers and
    streams; a row's draw changes with the data position (another epoch, another draw)."""
    calls = []

    def fake_generate(module, prompts, seeds, settings, zero3, attention, eos_id, pad_id):
        calls.append((module, seeds))
        return [torch.tensor([seed % 50]) for seed in seeds]
    monkeypatch.setattr("training.objectives.distill.on_policy.generate", fake_generate)
    section = DistillSection(teacher_model_name_or_path="t", lmbda=0.5, seq_kd=True)
    whole = {**rows_of(8), "row": torch.arange(8), "position": torch.tensor(3)}
    halves = [{key: value[part] if key != "position" else value for key, value in whole.items()}
              for part in (slice(0, 4), slice(4, 8))]

    def completed(batches):
        done, counts = sample_sequences(batches, section, 1234, {"student": "S", "teacher": "T"}, False, "sdpa", 2, 0)
        return torch.cat([batch["input_ids"] for batch in done]), counts
    together, counts = completed([whole])
    apart, apart_counts = completed(halves)
    assert torch.equal(together, apart) and counts == apart_counts
    assert counts["student"] + counts["teacher"] == 8 and 0 < counts["student"] < 8
    later, _ = completed([{**whole, "position": torch.tensor(4)}])
    assert not torch.equal(later, together)
    assert {module for module, _ in calls} == {"S", "T"}



def test_the_static_engine_samples_the_same_sequences(models):
    """distill.generation_engine: GRPO's static KV cache samples what generate samples, for the student and the
    teacher alike (tests/training/objectives/grpo/test_sampling.py proves every engine, compiled too)."""
    engine = "static"
    student = AutoModelForCausalLM.from_pretrained(models / "student").eval()
    teacher = AutoModelForCausalLM.from_pretrained(models / "teacher").eval()
    batch = {**rows_of(6), "row": torch.arange(6), "position": torch.tensor(0)}
    done = {}
    for name in ("generate", engine):
        section = DistillSection(teacher_model_name_or_path="t", lmbda=0.5, seq_kd=True, max_new_tokens=5,
                                 generation_engine=name)
        done[name], counts = sample_sequences([batch], section, 1234, {"student": student, "teacher": teacher},
                                              False, "sdpa", 2, 0)
    assert counts["student"] and counts["teacher"]
    assert torch.equal(done["generate"][0]["input_ids"], done[engine][0]["input_ids"])


def test_compiled_sampling_under_zero3_is_refused(models):
    with pytest.raises(ConfigError, match="generation_engine=compiled under ZeRO-3"):
        Distill.check(recipe(models, "distill.generation_engine=compiled"), None, 2, 3)
