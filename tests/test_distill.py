"""training.objective=distill against an independent plain-PyTorch loop: the student and a frozen teacher of another
shape, TRL's generalized_jsd_loss on the whole logits (GKDTrainer's) plus the next-token loss, torch's AdamW.

Eight chat conversations of tiny_llama_sft, all in every step's global batch (so their order does not matter), four
held out; a row each (data.packing=none). Every step samples: each conversation's completion is, by its seeded draw,
the student's (lmbda 0.5) or the teacher's (seq_kd), which the loop samples with the same function from the same
seeds (on_policy.py: the sampling itself is GRPO's, proven against generate in its tests). Runs:
- 1 rank, ZeRO-1, 4 steps: the uninterrupted curve, against the loop;
- 2 ranks, ZeRO-3 (the teacher partitioned, its head gathered once), activation checkpointing, checkpoints every 2
  steps, SIGKILLed in the middle of step 4's save, so `latest` stays at step 2; then resumed on 1 rank with ZeRO-2
  (another layout: through a universal checkpoint) to step 4;
- 2 ranks, ZeRO-3 with CPU offload, LoRA on the student, 4 steps: against the loop with the same adapters;
- 1 rank, ZeRO-0, offline (lmbda 0) at temperature 1, one micro-batch of all 8 rows a step: against TRL's GKDTrainer
  itself on the same rows (its loss takes temperature 1), step by step.
Tolerance (fp32; the engine sums the same terms in another order): 1e-5 absolute on the steps' losses, divergences
and the held-out loss and divergence at steps 2 and 4; the samples are the same tokens; against GKDTrainer 1e-5
relative (its divergence in fp32 from the whole logits, ours from TRL's fp32 tiles).
"""
import json
import math
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.gkd import GKDTrainer

from tests.conftest import REPO, run_train, save_small_checkpoint
from training.config.sections import LoraSection
from training.objectives.distill.on_policy import sample_sequences
from training.objectives.distill.spec import DistillSection
from training.planning.shape import lora_config

pytestmark = pytest.mark.slow

BETA, TEMPERATURE, LM_WEIGHT, LR, SEED, STEPS, NEW_TOKENS = 0.5, 0.9, 0.5, 1e-3, 1234, 4, 12
CHATS = (REPO / "recipes/tiny_llama_sft/chat.jsonl").read_text().splitlines()[:12]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "event" not in line]


def prepared(cache: Path) -> datasets.DatasetDict:
    """The rows the runs trained on (one preparation, which every run shares)."""
    [folder] = [path for path in cache.iterdir() if (path / "dataset_dict.json").is_file()]
    return datasets.load_from_disk(str(folder)).with_format("torch")


def losses(student, teacher, batch: dict) -> tuple[torch.Tensor, float, float]:
    """The loss (TRL's divergence, a token mean over the rows, plus LM_WEIGHT x the next-token loss), and the two."""
    inputs = {"input_ids": batch["input_ids"].long(), "position_ids": batch["position_ids"].long()}
    logits = student(**inputs).logits[:, :-1]
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits[:, :-1]
    labels = batch["labels"][:, 1:].long()
    divergence = GKDTrainer.generalized_jsd_loss(logits, teacher_logits, labels=labels, beta=BETA,
                                                 temperature=TEMPERATURE)
    next_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return divergence + LM_WEIGHT * next_token, divergence.item(), next_token.item()


def reference_loop(folder: Path, lora: bool = False) -> list[dict]:
    """Each step's loss and divergence, and the held-out loss and divergence at steps 2 and 4 (after the update);
    lora: the student's adapters (the run's LoRA settings, seeded as training/models/lora.py seeds them) trained."""
    rows = prepared(folder / "cache")
    tokenizer = AutoTokenizer.from_pretrained(folder / "student")
    student = AutoModelForCausalLM.from_pretrained(folder / "student", use_cache=False)
    if lora:
        torch.manual_seed(SEED)
        student = get_peft_model(student, lora_config(LoraSection(enabled=True)))
    student.train()
    teacher = AutoModelForCausalLM.from_pretrained(folder / "teacher", use_cache=False).eval()
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95),
                                  eps=1e-8, weight_decay=0.0)
    section = DistillSection(teacher_model_name_or_path="teacher", beta=BETA, temperature=TEMPERATURE, lmbda=0.5,
                             seq_kd=True, max_new_tokens=NEW_TOKENS, lm_loss_weight=LM_WEIGHT)
    train, held_out = rows["train"][:], rows["eval"][:]
    records = []
    for step in range(1, STEPS + 1):
        batch = {"row": torch.arange(len(train["input_ids"])), "position": torch.tensor(step - 1),
                 **{name: train[name].long() for name in ("input_ids", "labels", "position_ids", "length")}}
        [batch], _ = sample_sequences([batch], section, SEED, {"student": student, "teacher": teacher}, False,
                                      "sdpa", tokenizer.eos_token_id, tokenizer.pad_token_id)
        loss, divergence, _ = losses(student, teacher, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        records.append({"step": step, "loss": loss.item(), "divergence": divergence})
        if step % 2 == 0:
            with torch.no_grad():
                _, divergence, next_token = losses(student, teacher, held_out)
            records[-1].update(eval_loss=next_token, eval_divergence=divergence)
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("distill")
    save_small_checkpoint(folder / "student")
    save_small_checkpoint(folder / "teacher", {"hidden_size": 96, "num_hidden_layers": 3, "head_dim": 24})
    for name, chats in (("train", CHATS[:8]), ("eval", CHATS[8:])):
        (folder / f"{name}.jsonl").write_text("".join(chat + "\n" for chat in chats))
    common = ["--recipe", "tiny_llama_sft", f"model.name_or_path={folder / 'student'}", "training.objective=distill",
              f"distill.teacher_model_name_or_path={folder / 'teacher'}", f"distill.beta={BETA}",
              f"distill.temperature={TEMPERATURE}", "distill.lmbda=0.5", "distill.seq_kd=true",
              f"distill.max_new_tokens={NEW_TOKENS}", f"distill.lm_loss_weight={LM_WEIGHT}",
              f"data.sources=[{{path: {folder / 'train.jsonl'}, messages_field: messages}}]",
              f"data.eval.sources=[{{path: {folder / 'eval.jsonl'}, messages_field: messages}}]",
              "data.eval.fraction=0", "data.packing=none", "data.seq_len=128", f"data.cache_dir={folder / 'cache'}",
              "training.micro_batch_size=2", "training.global_batch_size=8", f"training.lr={LR}",
              "training.schedule=constant", "training.warmup_steps=0", "training.grad_clip=0",
              "training.eval_every_steps=2", "logging.every_steps=1", "precision=fp32", "logging.report_to=[]",
              f"training.max_steps={STEPS}"]
    whole, killed, resumed, lora, offline = (folder / name for name in ("whole", "killed", "resumed", "lora",
                                                                         "offline"))
    result = run_train(["--output-dir", str(whole), *common, "deepspeed.config=zero1"], ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_train(["--kill-after-deepspeed-save", "4", "--output-dir", str(killed), *common,
                        "deepspeed.config=zero3", "activation_checkpointing=true", "checkpointing.every_steps=2"],
                       ranks=2, script="tests/helpers/train_with_probes.py")
    assert result.returncode != 0 and (killed / "checkpoints/latest").read_text() == "global_step2"
    shutil.copytree(killed, resumed)
    result = run_train(["--output-dir", str(resumed), "--resume", *common, "deepspeed.config=zero2"], ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_train(["--output-dir", str(lora), *common, "deepspeed.config=zero3_offload", "lora.enabled=true"],
                       ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    gkd = ["distill.lmbda=0", "distill.seq_kd=false", "distill.temperature=1", "distill.lm_loss_weight=0",
           "training.micro_batch_size=8", "training.betas=[0.9,0.999]"]  # GKDTrainer's loss, one micro-batch a step
    result = run_train(["--output-dir", str(offline), *common, *gkd, "deepspeed.config=zero0"], ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"folder": folder, "whole": metrics(whole), "killed": metrics(killed), "resumed": metrics(resumed),
            "lora": metrics(lora), "offline": metrics(offline)}


def close(run: list[dict], expected: list[dict], steps) -> None:
    by_step = {record["step"]: record for record in run}
    for record in expected:
        if record["step"] in steps:
            for name in ("loss", "divergence", "eval_loss", "eval_divergence", "sampled/student", "sampled/teacher"):
                if name in record:
                    assert math.isclose(by_step[record["step"]][name], record[name], abs_tol=1e-5), (record, name)


def test_the_loss_is_trls_divergence_with_the_next_token_loss_step_by_step(runs):
    """Every step's loss and divergence, and the held-out loss and divergence, as the loop's: the same samples (the
    student's and the teacher's, drawn by the rows' seeds), TRL's loss on the whole logits, torch's AdamW."""
    expected = reference_loop(runs["folder"])
    close(runs["whole"], expected, range(1, STEPS + 1))
    assert 0 < runs["whole"][0]["sampled/student"] < 1 and runs["whole"][0]["sampled/teacher"] > 0


def test_zero3_on_two_ranks_and_a_resume_in_another_layout_stay_on_the_curve(runs):
    """ZeRO-3 on 2 ranks (the teacher partitioned, every rank sampling together) gives steps 1-2 of the 1-rank
    curve; killed in step 4's save and resumed from step 2 on 1 rank with ZeRO-2, steps 3-4 of it."""
    close(runs["killed"], runs["whole"], (1, 2))
    close(runs["resumed"], runs["whole"], (3, 4))


def test_a_lora_student_under_zero3_with_offload_is_the_loops(runs):
    """LoRA on the student, 2 ranks, ZeRO-3 with the parameters and optimizer offloaded to CPU (the teacher
    partitioned and offloaded as the student): the loop's curve with the same adapters."""
    close(runs["lora"], reference_loop(runs["folder"], lora=True), range(1, STEPS + 1))


def gkd_trainer_losses(folder: Path) -> list[float]:
    """TRL's GKDTrainer on the rows the runs trained on (right-padded with their attention mask), offline (lmbda 0),
    beta 0.5, its loss at temperature 1, the same optimizer: each step's logged loss."""
    from trl.experimental.gkd import GKDConfig

    from tests.helpers.trl_state import left_as_found
    rows = prepared(folder / "cache")["train"][:]
    train = datasets.Dataset.from_dict({name: rows[name].tolist() for name in ("input_ids", "labels", "length")})

    def collate(examples: list[dict]) -> dict:
        ids = torch.tensor([example["input_ids"] for example in examples])
        mask = (torch.arange(ids.shape[1])[None] < torch.tensor([e["length"] for e in examples])[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([e["labels"] for e in examples])}
    config = GKDConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=8, gradient_accumulation_steps=1,
                       max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                       weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
                       max_grad_norm=0.0, beta=BETA, lmbda=0.0, seq_kd=False, logging_steps=1, report_to="none",
                       save_strategy="no", use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0,
                       seed=SEED, remove_unused_columns=False)
    with left_as_found():
        trainer = GKDTrainer(model=AutoModelForCausalLM.from_pretrained(folder / "student", use_cache=False),
                             teacher_model=AutoModelForCausalLM.from_pretrained(folder / "teacher", use_cache=False),
                             args=config, train_dataset=train, data_collator=collate,
                             processing_class=AutoTokenizer.from_pretrained(folder / "student"))
        trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def test_offline_distillation_is_trls_gkd_trainer_step_by_step(runs):
    """lmbda 0 at temperature 1: every step's loss is GKDTrainer's on the same rows (TRL's whole logits and mask,
    our chunked divergence over the target tokens; the same AdamW)."""
    ours = [record["loss"] for record in runs["offline"]]
    theirs = gkd_trainer_losses(runs["folder"])
    assert len(ours) == len(theirs) == STEPS and ours[-1] < ours[0], (ours, theirs)
    for step, (mine, trl) in enumerate(zip(ours, theirs), start=1):
        assert mine == pytest.approx(trl, rel=1e-5, abs=1e-6), f"step {step}: {ours} vs {theirs}"
