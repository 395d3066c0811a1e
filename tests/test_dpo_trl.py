"""train.py's DPO against TRL's DPOTrainer (trl==1.16.0): the same checkpoint, pairs and settings, 4 steps, every
pair in every step (one batch of all 8 pairs, so neither side's order matters), compared step by step.

Both sides run fp32 and compute the same sums on differently laid out rows: ours packed (bfd, per-sequence
positions, the whole logits), TRL's right-padded with an attention mask (its fused head projecting only completion
positions, in tiles). In float64 the two layouts give the base model's summed log-probabilities to 2e-13; in fp32 they
differ by a few units of fp32's spacing at these sums (hundreds of tokens at about -3 each: spacing 3e-5 to 6e-5).
Hence, measured on tiny_llama_dpo's first pairs (chat / string / chat with every other loss type, weighted):
- loss: 1e-5 absolute, plus 2e-6 relative for the weighted sum of the others (whose terms reach 25 and 50 before their
  weights: IPO's and SPPO's squares) (measured 1.3e-6 / 1.1e-6 / 7.6e-6 at a loss of 4.7);
- rewards (beta x a difference of two such sums, averaged over 8 pairs): 1e-5 absolute (measured 3.5e-6 / 5.2e-6;
  pairs of sums near -1,000 can bring that to the tolerance itself);
- logps: 1e-6 relative (measured 6.1e-5 absolute, 2e-7 relative); grad_norm (no clipping on either side): 5e-5
  relative (measured 2e-6 / 5.8e-6 / 1.6e-6); accuracies: equal; the token means (TRL's fused head's against our
  chunked pass over the whole logits): entropy and logits/* 1e-5 relative or 1e-6 absolute (measured 1.1e-7 and
  6.8e-7 relative; a mean of logits of either sign can lie near 0, where fp32's rounding of its terms, absolute,
  is no longer small beside it: logits/chosen 0.0103336 against TRL's 0.0103337 at step 4 of the mixed loss types
  on one CPU, 1.5e-7 apart, 1.4e-5 relative),
  mean_token_accuracy to fp32's rounding of TRL's (TRL's 0.031578946858644485 at step 4 for our 6/190).
The weighted sum fails with one term changed: nca_pair's rejected weight 0.45 for 0.5 moves step 1's loss by 0.024.
RPO ([sigmoid, sft]): loss within 9.5e-7, grad_norm 2.3e-6; the JS divergence's mix: 2.1e-6 and 7.4e-6; LD-DPO
([sigmoid, ipo], ld_alpha 0.4) with WPO's weights (use_weighting): 8.3e-7 and 2.4e-6 (without the weights step 1's
loss is 1.943 for TRL's 1.778); TR-DPO (sync_ref_model every 2 steps, alpha 0.6): 2.4e-6 and 5.6e-6 (step 3's
loss 0.569 against the synced reference, 0.403 unsynced); AOT ([aot, aot_unpaired]): 1.5e-6 and 2.4e-6 (unsorted,
step 2 is 3.6e-3 apart).
"""
import json

import pytest
import torch

from tests.conftest import REPO, run_train, save_small_checkpoint
from tests.helpers.trl_state import left_as_found

PAIRS, STEPS, LR, BETA = 8, 4, 1e-3, 0.1
SIGMOID = {"loss_type": ["sigmoid"]}
RPO = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}  # DPO plus the chosen completions' NLL
# f-DPO, on the losses of the reward difference; an alpha divergence's exp(-(1 - alpha) u) amplifies the layouts'
# rounding: at alpha 0.7 steps 1-2 agree (loss 6e-7, grad_norm 5.2e-6) and step 3 is 5e-5 apart, so it is checked
# against its closed form (tests/training/objectives/dpo/test_objective.py) and the bounded JS divergence here
# LD-DPO (tails count 0.4), with WPO's weights (use_weighting: each pair's loss times its sequences' weights)
LD = {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.05], "ld_alpha": 0.4, "use_weighting": True}
JS = {"loss_type": ["sigmoid", "robust", "ipo", "hinge"], "loss_weights": [1.0, 0.5, 0.05, 0.3], "label_smoothing": 0.1,
      "f_divergence_type": "js_divergence"}
# every loss type but sigmoid's at once, each with a weight of its own: a wrong term moves the sum
MIX = {"loss_type": ["hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
                     "discopop", "sigmoid_norm"],
       "loss_weights": [0.9, 0.05, 0.8, 0.7, 0.6, 0.5, 0.002, 0.4, 0.3, 0.2, 0.1], "label_smoothing": 0.1}
# AOT's two sorted losses (over the 8 pairs: the micro-batch here, TRL's per-device batch), label-smoothed at 0.1
AOT = {"loss_type": ["aot", "aot_unpaired"], "loss_weights": [1.0, 0.5], "label_smoothing": 0.1}
# TR-DPO: the policy mixed into the reference after steps 2 and 4 (steps 3-4 against the synced one)
SYNC = {"loss_type": ["sigmoid"], "sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.6}
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
LOGPS = ("logps/chosen", "logps/rejected")
TOKENS = ("entropy", "logits/chosen", "logits/rejected")  # means over the completion tokens


def chat_pairs() -> list[dict]:
    """The first pairs of tiny_llama_dpo's data: conversations, with system turns and multi-turn prompts."""
    lines = (REPO / "recipes/tiny_llama_dpo/pairs.jsonl").read_text().splitlines()[:PAIRS]
    return [{key: pair[key] for key in ("prompt", "chosen", "rejected")} for pair in map(json.loads, lines)]


def string_pairs() -> list[dict]:
    """The same pairs as plain text; one chosen already ends with EOS (neither side adds a second)."""
    pairs = [{"prompt": f"Q: {pair['prompt'][-1]['content']}\nA:", "chosen": " " + pair["chosen"][0]["content"],
              "rejected": " " + pair["rejected"][0]["content"]} for pair in chat_pairs()]
    pairs[0]["chosen"] += "</s>"
    return pairs


def recipe_yaml(base, pairs, cache, losses: dict) -> str:
    dpo = {"beta": BETA, "loss": losses["loss_type"],
           **{key: value for key, value in losses.items() if key != "loss_type"}}
    return f"""
model: {{name_or_path: {base}}}
data: {{sources: [{{path: {pairs}}}], seq_len: 1024, packing: bfd, long_documents: drop, dedup: {{exact: false}},
        cache_dir: {cache}}}
training: {{objective: dpo, micro_batch_size: {PAIRS}, global_batch_size: {PAIRS}, max_steps: {STEPS}, lr: {LR},
           schedule: constant, warmup_steps: 0, weight_decay: 0.0, betas: [0.9, 0.999], eps: 1.0e-8, grad_clip: 0}}
dpo: {json.dumps(dpo)}
deepspeed: {{config: zero0}}
precision: fp32
logging: {{every_steps: 1}}
stability: {{enabled: false}}
"""


def trl_logs(base, pairs: list[dict], out, losses: dict) -> list[dict]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    config = DPOConfig(output_dir=str(out), per_device_train_batch_size=PAIRS, gradient_accumulation_steps=1,
                       max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                       weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
                       max_grad_norm=0.0, beta=BETA, **losses, max_length=1024, logging_steps=1,
                       report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
                       dataloader_num_workers=0, seed=1234)
    with left_as_found():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        trainer = DPOTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(pairs),
                             processing_class=AutoTokenizer.from_pretrained(base))
        trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


@pytest.mark.slow
@pytest.mark.parametrize("form, losses", [("chat", SIGMOID), ("string", SIGMOID), ("chat", RPO), ("chat", MIX),
                                          ("chat", JS), ("chat", LD), ("chat", SYNC), ("chat", AOT)],
                         ids=["chat", "string", "sigmoid and sft", "every other loss type", "a JS divergence",
                              "length-desensitized and weighted", "a synced reference", "sorted"])
def test_dpo_matches_trl_step_by_step(form, losses, tmp_path):
    pairs = chat_pairs() if form == "chat" else string_pairs()
    base, data = tmp_path / "base", tmp_path / "pairs.jsonl"
    save_small_checkpoint(base)
    data.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    (tmp_path / "recipe.yaml").write_text(recipe_yaml(base, data, tmp_path / "cache", losses))
    result = run_train(["--recipe", str(tmp_path / "recipe.yaml"), "--output-dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    ours = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    theirs = trl_logs(base, pairs, tmp_path / "trl", losses)

    assert [r["step"] for r in ours] == [log["step"] for log in theirs] == list(range(1, STEPS + 1))
    assert json.loads((tmp_path / "run/summary.json").read_text())["data"]["pairs"] == PAIRS, "no pair left out"
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.05, "the losses must move for the comparison to mean anything"
    for step, (mine, trl) in enumerate(zip(ours, theirs), start=1):
        assert mine["loss"] == pytest.approx(trl["loss"], rel=2e-6, abs=1e-5), f"step {step}: loss"
        for name in REWARDS:
            assert mine[name] == pytest.approx(trl[name], abs=1e-5), f"step {step}: {name}"
        for name in LOGPS:
            assert mine[name] == pytest.approx(trl[name], rel=1e-6), f"step {step}: {name}"
        assert mine["rewards/accuracies"] == trl["rewards/accuracies"], f"step {step}"
        for name in TOKENS:
            assert mine[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-6), f"step {step}: {name}"
        assert mine["mean_token_accuracy"] == pytest.approx(trl["mean_token_accuracy"], abs=1e-7), f"step {step}"
        assert mine["grad_norm"] == pytest.approx(trl["grad_norm"], rel=5e-5), f"step {step}: grad_norm"
