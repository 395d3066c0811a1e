"""training.objective=dpo against an independent plain-PyTorch loop: a policy and a frozen reference (for LoRA, peft's
adapters disabled), each sequence run alone (no packing, no padding), the same loss formula and torch's AdamW.

Eight chat pairs from tiny_llama_dpo, all in every step's global batch (so the order of pairs does not matter), four
held out for evaluation. train.py packs them (bfd, 2 pairs per micro-batch) and computes the reference in its pass
before step 1 (LoRA: adapters disabled beside each step). Runs:
- 1 rank, ZeRO-1, 6 steps: the uninterrupted curve;
- 2 ranks, ZeRO-3, checkpointing every 2 steps, SIGKILLed in the middle of step 4's save, so `latest` stays at step 2;
  then resumed on 1 rank with ZeRO-2 (another layout: through a universal checkpoint) to step 6; both with the sft
  term (weight 0.5), whose mean is over the global batch's chosen tokens: 4 micro-batches on 2 ranks, then 4 on 1;
- 2 ranks, ZeRO-3 with CPU offload, LoRA, activation checkpointing, IPO's loss weighted by WPO (use_weighting), 4
  steps;
- TR-DPO (sync_ref_model, every 2 steps): 2 ranks, ZeRO-3 (the reference partitioned), killed in step 4's save and
  resumed on 1 rank with ZeRO-2, the synced reference restored from the step-2 checkpoint (saved gathered, loaded
  whole), against the loop's reference mixed alike.
Tolerance (fp32; the engine sums the same terms in another order): 1e-5 absolute on the steps' losses and rewards,
1e-5 relative on the summed log-probabilities (-100 to -1,000, where fp32's spacing is 1e-5 to 6e-5), 5e-5 absolute on
the evaluation loss at steps 2, 4 and 6 (measured 1.5e-5 at step 6: after six updates at lr 1e-3 the two policies
differ by those rounding differences, and the held-out pairs' log-ratios grow large).
"""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, run_train, save_small_checkpoint
from training.objectives.dpo.spec import REFERENCE_FILE

pytestmark = pytest.mark.slow

BETA, LR, SEED, STEPS = 0.1, 1e-3, 1234, 6
RPO_WEIGHT = 0.5  # the sft term's weight in the killed and resumed runs (RPO: DPO plus the chosen's NLL)
SYNC_STEPS, SYNC_ALPHA = 2, 0.6  # TR-DPO's: the reference becomes 0.6 x the policy + 0.4 x itself every 2 steps
PAIRS = [json.loads(line) for line in (REPO / "recipes/tiny_llama_dpo/pairs.jsonl").read_text().splitlines()[:12]]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "event" not in line]


def shared_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def pair_tokens(tokenizer, pair: dict) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]:
    """Each conversation's tokens and where the completions start: where the tokenized prompt stops being a prefix of
    either (a reply may begin with a character that merges with the prompt's last token), as TRL takes it."""
    prompt_text = tokenizer.apply_chat_template(pair["prompt"], tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    sequences = []
    for completion in (pair["chosen"], pair["rejected"]):
        text = tokenizer.apply_chat_template(pair["prompt"] + completion, tokenize=False)
        assert text.startswith(prompt_text)
        sequences.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    start = min(shared_length(prompt, ids) for ids in sequences)
    return (torch.tensor(sequences[0]), start), (torch.tensor(sequences[1]), start)


def logp(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, ids[1:, None])[start - 1:].sum()


def pair_logps(model, sequences) -> torch.Tensor:
    return torch.stack([torch.stack([logp(model, *chosen), logp(model, *rejected)]) for chosen, rejected in sequences])


def wpo_weight(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """WPO's weight of a sequence, from the paper's formula: exp of the completion tokens' mean of
    log p(token) - log sum_v p(v)^2, without a gradient."""
    with torch.no_grad():
        logps = model(input_ids=ids[None]).logits[0, :-1].float().log_softmax(-1)[start - 1:]
        probabilities = logps.exp()
        return (logps.gather(1, ids[start:, None])[:, 0] - (probabilities ** 2).sum(-1).log()).mean().exp()


def token_metrics(model, pairs) -> dict:
    """TRL's token metrics of the pairs, from each sequence alone: the policy's entropy over every completion token,
    the logits' mean over the vocabulary per completion token of the chosen and of the rejected, and the share of the
    chosen tokens the policy ranks first."""
    sums = torch.zeros(2, 4, dtype=torch.float64)  # [chosen, rejected] x [entropy, mean logit, hits, tokens]
    with torch.no_grad():
        for pair in pairs:
            for side, (ids, start) in enumerate(pair):
                logits = model(input_ids=ids[None]).logits[0, :-1].double()[start - 1:]
                entropy = torch.distributions.Categorical(logits=logits).entropy()
                hits = logits.argmax(-1) == ids[start:]
                sums[side] += torch.stack([entropy.sum(), logits.mean(-1).sum(), hits.sum(), torch.tensor(len(hits))])
    return {"entropy": (sums[:, 0].sum() / sums[:, 3].sum()).item(),
            "logits/chosen": (sums[0, 1] / sums[0, 3]).item(), "logits/rejected": (sums[1, 1] / sums[1, 3]).item(),
            "mean_token_accuracy": (sums[0, 2] / sums[0, 3]).item()}


def reference_loop(base: Path, steps: int, lora: bool = False, ipo: bool = False, sft: float = 0.0,
                   wpo: bool = False, sync: bool = False) -> list[dict]:
    """Each step's loss, rewards, log-probabilities and token metrics, and the evaluation's loss at steps 2, 4, 6
    (after the update).
    ipo: IPO's loss, on the log-ratios' means over the completion tokens. sft: the weight of the chosen completions'
    negative log-likelihood, a mean over all their tokens, added to the pairs' mean loss (TRL's sft loss type). wpo:
    each pair's loss times its two sequences' WPO weights. sync: after every SYNC_STEPS-th step the frozen reference
    becomes SYNC_ALPHA x the policy + (1 - SYNC_ALPHA) x itself, and its values are taken again (TR-DPO)."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    sequences = [pair_tokens(tokenizer, pair) for pair in PAIRS]
    train, held_out = sequences[:8], sequences[8:]
    policy = AutoModelForCausalLM.from_pretrained(base, use_cache=False)
    frozen = AutoModelForCausalLM.from_pretrained(base, use_cache=False).eval()
    if lora:
        torch.manual_seed(SEED)  # as training/models/lora.py seeds the adapters
        policy = get_peft_model(policy, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                   task_type="CAUSAL_LM"))
    policy.train()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=0.0)

    def reference(pairs):
        with torch.no_grad():
            if lora:
                with policy.disable_adapter():
                    return pair_logps(policy, pairs)
            return pair_logps(frozen, pairs)

    def losses(pairs, reference_logps):
        logps = pair_logps(policy, pairs)
        ratios = logps - reference_logps
        tokens = torch.tensor([[len(ids) - start for ids, start in pair] for pair in pairs])
        if ipo:
            means = ratios / tokens
            pair_losses = (means[:, 0] - means[:, 1] - 1 / (2 * BETA)) ** 2
        else:
            pair_losses = -F.logsigmoid(BETA * (ratios[:, 0] - ratios[:, 1]))
        if wpo:
            pair_losses = pair_losses * torch.stack([wpo_weight(policy, *chosen) * wpo_weight(policy, *rejected)
                                                     for chosen, rejected in pairs])
        loss = pair_losses.mean() - sft * logps[:, 0].sum() / tokens[:, 0].sum()
        return loss, BETA * ratios.detach(), logps.detach()

    fixed = {"train": reference(train), "eval": reference(held_out)}
    records = []
    for step in range(1, steps + 1):
        before = token_metrics(policy, train)
        loss, rewards, logps = losses(train, fixed["train"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if sync and step % SYNC_STEPS == 0:
            with torch.no_grad():
                for mine, theirs in zip(frozen.parameters(), policy.parameters(), strict=True):
                    mine.mul_(1 - SYNC_ALPHA).add_(theirs, alpha=SYNC_ALPHA)
            fixed = {"train": reference(train), "eval": reference(held_out)}
        records.append({"step": step, "loss": loss.item(), "rewards/chosen": rewards[:, 0].mean().item(),
                        "rewards/rejected": rewards[:, 1].mean().item(),
                        "rewards/margins": (rewards[:, 0] - rewards[:, 1]).mean().item(),
                        "logps/chosen": logps[:, 0].mean().item(), "logps/rejected": logps[:, 1].mean().item(),
                        **before})
        if step % 2 == 0:
            with torch.no_grad():
                records[-1]["eval_loss"] = losses(held_out, fixed["eval"])[0].item()
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("dpo")
    save_small_checkpoint(folder / "base")
    for name, pairs in (("train", PAIRS[:8]), ("eval", PAIRS[8:])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    common = ["--recipe", "tiny_llama_dpo", f"model.name_or_path={folder / 'base'}",
              f"data.sources=[{{path: {folder / 'train.jsonl'}}}]",
              f"data.eval.sources=[{{path: {folder / 'eval.jsonl'}}}]",
              "data.eval.fraction=0", f"data.cache_dir={folder / 'cache'}", "training.micro_batch_size=2",
              "training.global_batch_size=8", f"training.lr={LR}", "training.schedule=constant",
              "training.warmup_steps=0",
              "training.grad_clip=0", "training.eval_every_steps=2", "logging.every_steps=1", "precision=fp32",
              "logging.report_to=[]"]
    whole, killed, resumed, lora, synced, synced_resumed = (folder / name for name in (
        "whole", "killed", "resumed", "lora", "synced", "synced_resumed"))
    result = run_train(["--output-dir", str(whole), *common, f"training.max_steps={STEPS}", "deepspeed.config=zero1"],
                       ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    rpo = ["dpo.loss=[sigmoid,sft]", f"dpo.loss_weights=[1.0,{RPO_WEIGHT}]"]
    result = run_train(["--kill-after-deepspeed-save", "4", "--output-dir", str(killed), *common, *rpo,
                        f"training.max_steps={STEPS}", "deepspeed.config=zero3", "checkpointing.every_steps=2"],
                       ranks=2, script="tests/helpers/train_with_probes.py")
    assert result.returncode != 0 and (killed / "checkpoints/latest").read_text() == "global_step2"
    shutil.copytree(killed, resumed)
    result = run_train(["--output-dir", str(resumed), "--resume", *common, *rpo, f"training.max_steps={STEPS}",
                        "deepspeed.config=zero2"], ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_train(["--output-dir", str(lora), *common, "training.max_steps=4", "deepspeed.config=zero3_offload",
                        "lora.enabled=true", "activation_checkpointing=true", "dpo.loss=ipo", "dpo.use_weighting=true"],
                       ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    sync = ["dpo.sync_ref_model=true", f"dpo.ref_model_sync_steps={SYNC_STEPS}",
            f"dpo.ref_model_mixup_alpha={SYNC_ALPHA}", f"training.max_steps={STEPS}"]
    result = run_train(["--kill-after-deepspeed-save", "4", "--output-dir", str(synced), *common, *sync,
                        "deepspeed.config=zero3", "checkpointing.every_steps=2"],
                       ranks=2, script="tests/helpers/train_with_probes.py")
    assert result.returncode != 0 and (synced / "checkpoints/latest").read_text() == "global_step2"
    shutil.copytree(synced, synced_resumed)
    result = run_train(["--output-dir", str(synced_resumed), "--resume", *common, *sync, "deepspeed.config=zero2"],
                       ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"base": folder / "base", "whole": whole, "killed": killed, "resumed": resumed, "lora": lora,
            "synced": synced, "synced_resumed": synced_resumed}


def assert_same_curve(records: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in records] == [e["step"] for e in expected]
    for record, reference in zip(records, expected):
        for key, value in reference.items():
            # rel 1e-6 besides: IPO's loss is near 25, where fp32 sums in another order differ by 4.6e-7 of it on
            # an AVX2 CPU (AMD EPYC; 1.1e-5 absolute at step 4), within 1e-5 on the machine where it was first measured;
            # rewards/margins 1.05e-5 apart at step 3 of TR-DPO's killed run under CI's load (passing alone)
            tolerance = {"rel": 1e-5} if key.startswith("logps/") else {"abs": 5e-5 if key == "eval_loss" else 2e-5,
                                                                        "rel": 1e-6}
            assert record[key] == pytest.approx(value, **tolerance), (record["step"], key)


@pytest.fixture(scope="module")
def expected(runs) -> list[dict]:
    return reference_loop(runs["base"], STEPS)


@pytest.fixture(scope="module")
def expected_rpo(runs) -> list[dict]:
    return reference_loop(runs["base"], STEPS, sft=RPO_WEIGHT)


def test_dpo_equals_an_independent_reference_loop_on_one_rank_and_under_zero3(runs, expected, expected_rpo):
    assert expected[0]["loss"] == pytest.approx(math.log(2)) and expected[-1]["loss"] < 0.6  # the loss moves
    assert_same_curve(metrics(runs["whole"]), expected)
    killed = metrics(runs["killed"])
    assert expected_rpo[0]["loss"] > expected[0]["loss"] + 1  # the sft term: half the chosen tokens' mean NLL
    assert_same_curve(killed, expected_rpo[:len(killed)])  # 2 ranks, ZeRO-3, with the sft term, until the kill
    whole = metrics(runs["whole"])
    assert whole[0]["rewards/accuracies"] == 0 and whole[-1]["rewards/accuracies"] == 1
    assert json.loads((runs["whole"] / "summary.json").read_text())["reference_pass_s"] > 0


def test_a_killed_dpo_run_resumes_in_another_layout_with_its_stored_reference(runs, expected_rpo):
    assert_same_curve(metrics(runs["resumed"]), expected_rpo)  # steps 1-2 from the killed run, 3-6 resumed
    killed_reference = (runs["killed"] / REFERENCE_FILE).read_bytes()
    assert (runs["resumed"] / REFERENCE_FILE).read_bytes() == killed_reference  # read again, not recomputed
    assert "reference_pass_s" not in json.loads((runs["resumed"] / "summary.json").read_text())


def test_ipo_with_lora_offload_and_checkpointing_takes_the_base_without_adapters_as_reference(runs):
    """And weighted by WPO, whose weights move the loss: without them it differs from step 1."""
    expected = reference_loop(runs["base"], 4, lora=True, ipo=True, wpo=True)
    assert_same_curve(metrics(runs["lora"]), expected)
    assert reference_loop(runs["base"], 1, lora=True, ipo=True)[0]["loss"] > expected[0]["loss"] * 1.01
    assert not (runs["lora"] / REFERENCE_FILE).exists()
    assert (runs["lora"] / "adapter" / "adapter_config.json").is_file()


def test_tr_dpo_syncs_its_reference_and_resumes_it_in_another_layout(runs, expected):
    """The synced reference under ZeRO-3 on 2 ranks until the kill, then restored from the step-2 checkpoint on 1 rank
    at ZeRO-2: the loop's curve with the reference mixed alike, which leaves the plain curve at step 2's evaluation
    (after the sync) and step 3's loss."""
    synced = reference_loop(runs["base"], STEPS, sync=True)
    before = [{key: value for key, value in record.items() if key != "eval_loss"} for record in synced[:2]]
    assert before == [{key: value for key, value in record.items() if key != "eval_loss"} for record in expected[:2]]
    assert synced[1]["eval_loss"] != expected[1]["eval_loss"] and synced[2]["loss"] > expected[2]["loss"] + 0.01
    killed = metrics(runs["synced"])
    assert_same_curve(killed, synced[:len(killed)])
    assert_same_curve(metrics(runs["synced_resumed"]), synced)  # steps 1-2 from the killed run, 3-6 resumed
    assert (runs["synced"] / "checkpoints/global_step2/reference.safetensors").is_file()
    assert not (runs["synced"] / REFERENCE_FILE).exists()  # no stored values: the reference runs beside each step
