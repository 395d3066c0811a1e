"""The stability guard's decisions, fed losses and gradient norms directly (the runs themselves, with poisoned
batches on 2 ranks: tests/test_stability.py)."""
import json
import math

import pytest
import torch

from training.compat.deepspeed.engine_step import withheld_step
from training.config.sections import StabilitySection
from training.loop.stability import StabilityGuard


def guard(tmp_path, **settings) -> StabilityGuard:
    return StabilityGuard(StabilitySection(**{"min_history": 5, "window": 5, "spike_grad_factor": 10.0, **settings}),
                          fp16=False, checkpoint_dir=tmp_path)


def attempt(guard: StabilityGuard, step: int, loss: float, grad_norm: float = 1.0, skipped: bool | None = None,
            pipeline: bool = False) -> dict | None:
    """One step as train.py makes it: the loss judged before the step (not in a pipeline), then the outcome; a
    step judged bad is one DeepSpeed skipped."""
    if pipeline:
        guard.loss, guard.reason, guard.judged = loss, None, False
    else:
        guard.loss, guard.reason, guard.judged = loss, guard.loss_verdict(loss), True
    if skipped is None:
        skipped = guard.reason is not None
    return guard.after_step(step, step - 1, grad_norm, skipped)


def warm(guard: StabilityGuard, steps: int = 5) -> None:
    for step in range(1, steps + 1):
        assert attempt(guard, step, 5.0 + 0.01 * (step % 2)) is None


def test_healthy_steps_make_no_events_and_a_spike_needs_a_history(tmp_path):
    g = guard(tmp_path)
    assert attempt(g, 1, 9.0) is None and attempt(g, 2, 3.0) is None  # no history yet: large moves are fine
    warm(g)
    assert attempt(g, 6, 5.02) is None
    assert g.summary() == {"skip": 0, "spike": 0, "rewind": 0, "stop": 0, "events": []}


@pytest.mark.parametrize("loss, reason", [(math.nan, "nonfinite_loss"), (math.inf, "nonfinite_loss"),
                                          (5.5, "loss_spike")])
def test_a_bad_loss_is_skipped_with_its_evidence(tmp_path, loss, reason):
    g = guard(tmp_path)
    warm(g)
    event = attempt(g, 6, loss)
    assert event["event"] == "skip" and event["reason"] == reason and event["step"] == 6
    assert event["data_position"] == 5 and "grad_norm" not in event  # DeepSpeed reports no norm for a dropped step
    assert math.isnan(event["loss"]) if math.isnan(loss) else event["loss"] == loss  # metrics.jsonl's writer: text
    if reason == "loss_spike":
        assert event["threshold"] == pytest.approx(5.004 + 6 * 0.0049, rel=1e-3)  # mean + 6 sigma of the window
    assert attempt(g, 6, 5.0) is None  # the same step, on the next batch


def test_a_nonfinite_gradient_under_a_finite_loss_is_named(tmp_path):
    g = guard(tmp_path)
    assert attempt(g, 1, 5.0, skipped=True)["reason"] == "nonfinite_grad"
    fp16 = StabilityGuard(StabilitySection(max_skips=1), fp16=True, checkpoint_dir=tmp_path)
    event = attempt(fp16, 1, 5.0, skipped=True)
    assert (event["event"], event["reason"]) == ("skip", "fp16_overflow")  # DeepSpeed's loss scaling: not counted


def test_a_gradient_spike_is_logged_as_applied_or_rewound(tmp_path):
    g = guard(tmp_path)
    warm(g)
    event = attempt(g, 6, 5.0, grad_norm=11.0)
    assert (event["event"], event["reason"], event["threshold"]) == ("spike", "grad_spike", 10.0)
    assert attempt(g, 7, 5.0, grad_norm=9.0) is None
    rewinding = guard(tmp_path, policy="rewind")
    warm(rewinding)
    (tmp_path / "latest").write_text("global_step4")
    assert attempt(rewinding, 6, 5.0, grad_norm=11.0)["event"] == "rewind"


def test_too_many_skips_in_the_window_stop_the_run(tmp_path):
    g = guard(tmp_path, max_skips=3, skip_window=10)
    warm(g)
    assert attempt(g, 6, math.nan)["event"] == "skip"
    assert attempt(g, 6, math.nan)["event"] == "skip"
    assert attempt(g, 6, 5.0) is None
    for step in range(7, 17):
        assert attempt(g, step, 5.0) is None
    assert attempt(g, 17, math.nan)["event"] == "skip"  # the skips at step 6 are out of the 10-step window
    assert attempt(g, 17, math.nan)["event"] == "skip"
    stop = attempt(g, 17, math.nan)
    assert stop["event"] == "stop" and "3 batches skipped within 10 steps (stability.max_skips)" in stop["message"]


def test_rewinds_need_a_checkpoint_and_are_limited(tmp_path):
    g = guard(tmp_path / "none", policy="rewind")
    warm(g)
    stop = attempt(g, 6, 50.0)
    assert stop["event"] == "stop" and "a spike before the first checkpoint" in stop["message"]
    (tmp_path / "latest").write_text("global_step4")
    g = guard(tmp_path, policy="rewind", max_rewinds=2)
    warm(g)
    assert attempt(g, 6, 50.0)["event"] == "rewind"
    g.rewound(4)
    assert attempt(g, 5, 50.0)["event"] == "rewind"  # the history stays: the detector is still armed
    g.rewound(4)
    stop = attempt(g, 5, 50.0)
    assert stop["event"] == "stop" and "2 rewinds did not get past the spikes" in stop["message"]


def test_a_pipeline_spike_is_judged_after_its_step(tmp_path):
    g = guard(tmp_path)
    warm(g)
    event = attempt(g, 6, 50.0, pipeline=True, skipped=False)
    assert (event["event"], event["reason"]) == ("spike", "loss_spike")  # applied: the pipeline stepped already
    event = attempt(g, 7, math.nan, pipeline=True, skipped=True)
    assert (event["event"], event["reason"]) == ("skip", "nonfinite_loss")


def test_a_poisoned_step_that_was_applied_is_a_bug_not_a_skip(tmp_path):
    g = guard(tmp_path)
    with pytest.raises(RuntimeError, match="applied with NaN gradients"):
        attempt(g, 1, math.nan, skipped=False)


def test_the_lowered_learning_rate_holds_after_a_rewind(tmp_path):
    class Engine:  # what set_lr reads of DeepSpeed's engine
        def __init__(self):
            self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 0.5)

        def get_lr(self):
            return [group["lr"] for group in self.optimizer.param_groups]

    g, engine = guard(tmp_path, policy="rewind", rewind_lr_factor=0.1, rewind_lr_steps=2), Engine()
    g.rewound(4)
    assert [g.set_lr(engine, step) for step in (5, 6, 7)] == pytest.approx([0.05, 0.05, 0.5])


def test_a_withheld_step_leaves_the_optimizer_as_it_was():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.full((3,), math.nan)
    with withheld_step(optimizer):
        optimizer.step()
        assert optimizer.overflow is True  # what DeepSpeed's engine reads: no schedule step, a skipped step counted
    assert torch.equal(weight.detach(), torch.ones(3)) and not optimizer.state
    assert not hasattr(optimizer, "overflow")
    weight.grad = torch.ones(3)
    optimizer.step()
    assert not torch.equal(weight.detach(), torch.ones(3))


def test_a_history_longer_than_its_window_is_refused(tmp_path):
    from training.base.errors import ConfigError
    from training.config.recipe import load_recipe
    with pytest.raises(ConfigError, match="stability.min_history=60 is more than stability.window=50"):
        load_recipe("tiny_llama", ["stability.min_history=60"])
    with pytest.raises(ConfigError, match="stability.policy=rewind goes back to the last checkpoint"):
        load_recipe("tiny_llama", ["stability.policy=rewind", "checkpointing.every_steps=null"])


@pytest.mark.slow
def test_the_shipped_settings_let_a_real_training_curve_through(tmp_path):
    """The false-alarm check: tiny_llama's stability settings judge every step of a real training run (a 2-layer
    shrink of tiny_llama, the recipe's optimizer settings and schedule, on its bundled corpus, in plain PyTorch) and
    raise no event; the same guard then flags a loss three times the last one."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import REPO
    from training.config.recipe import load_recipe
    from training.loop.optimizer import lr_schedule
    recipe = load_recipe("tiny_llama", ["training.max_steps=80"])
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer")
    texts = [json.loads(line)["text"] for line in (REPO / "recipes/tiny_llama/corpus.jsonl").read_text().splitlines()]
    tokens = torch.tensor([t for ids in tokenizer(texts[:200])["input_ids"] for t in [*ids, tokenizer.eos_token_id]])
    rows = tokens[:len(tokens) // 64 * 64].view(-1, 64)
    torch.manual_seed(recipe.training.seed)
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=2, hidden_size=64,
                                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16)
    model = AutoModelForCausalLM.from_config(config)
    training = recipe.training
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, betas=training.betas, eps=training.eps,
                                  weight_decay=training.weight_decay)
    schedule = lr_schedule(training, training.max_steps)(optimizer)
    g = StabilityGuard(recipe.stability, fp16=False, checkpoint_dir=tmp_path)
    losses = []
    for step in range(1, training.max_steps + 1):
        batch = rows[torch.randint(len(rows), (training.micro_batch_size,))]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
        optimizer.step(), schedule.step(), optimizer.zero_grad()
        losses.append(loss.item())
        assert attempt(g, step, losses[-1], float(grad_norm)) is None, f"a false alarm at step {step}: {g.events}"
    assert losses[-1] < losses[0] - 1  # a real curve: it learned
    assert attempt(g, training.max_steps + 1, 3 * losses[-1])["reason"] == "loss_spike"
