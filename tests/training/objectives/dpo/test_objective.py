"""DPO's pieces: a packed micro-batch gives every sequence the log-probability it has alone (so packed pairs give the
same loss as unpacked), and the losses and rewards are the papers' formulas."""
import math
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from data_pipeline.preference import pack_pairs
from tests.conftest import REPO, save_small_checkpoint
from training.base.errors import ConfigError
from training.config.recipe import load_recipe
from training.objectives.dpo import reference_logps
from training.objectives.dpo.loss import chosen_targets, described_loss, f_divergence_scores, pair_losses
from training.objectives.dpo.objective import Dpo
from training.objectives.dpo.preference_loss import pair_logps
from training.objectives.dpo.spec import DpoSection


@pytest.fixture(scope="module")
def model():
    # use_cache=False as training/models/model.py builds it: packed attention
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=2, hidden_size=64,
                                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def alone(model, sequence: np.ndarray, prompt: int) -> float:
    """A sequence's completion log-probability, run by itself: no packing, no padding."""
    ids = torch.from_numpy(sequence).long()[None]
    logps = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    return float(logps[prompt - 1:].sum())


@pytest.mark.parametrize("packing", ["bfd", "none"])
def test_packed_pairs_give_each_sequence_its_log_probability_alone(model, packing):
    rng = np.random.default_rng(1)
    chosen = [rng.integers(3, 1000, rng.integers(5, 30)) for _ in range(5)]
    rejected = [rng.integers(3, 1000, rng.integers(5, 30)) for _ in range(5)]
    prompts = np.array([3, 1, 4, 2, 4])
    batch = pack_pairs(chosen, rejected, prompts, 64, 0, packing)
    with torch.no_grad():
        logps, tokens, *_ = pair_logps(model, batch, torch.device("cpu"))
        expected = [[alone(model, c, p), alone(model, r, p)] for c, r, p in zip(chosen, rejected, prompts)]
    torch.testing.assert_close(logps, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert tokens.tolist() == [[len(c) - p, len(r) - p] for c, r, p in zip(chosen, rejected, prompts)]


def test_the_sft_terms_count_is_the_chosen_target_tokens_of_the_real_pairs(model):
    """What the step's sft mean divides by, counted before the forward pass as the forward pass counts them; a padding
    pair (the last, `real` False, as the loader marks a short micro-batch's) is left out."""
    rng = np.random.default_rng(2)
    chosen = [rng.integers(3, 1000, length) for length in (9, 12, 7)]
    rejected = [rng.integers(3, 1000, length) for length in (6, 15, 5)]
    batch = pack_pairs(chosen, rejected, np.array([4, 2, 3]), 64, 0, "bfd")
    batch["real"] = torch.tensor([True, True, False])
    with torch.no_grad():
        tokens = pair_logps(model, batch, torch.device("cpu"))[1]
    assert chosen_targets(batch) == int(tokens[batch["real"], 0].sum()) == (9 - 4) + (12 - 2)


def test_ld_alpha_weighs_the_tokens_past_the_shorter_completion(model):
    """LD-DPO on packed pairs equals each sequence alone: its first min(chosen, rejected) completion tokens' summed
    log-probability plus alpha times the rest's (TRL's shared and tail masks)."""
    rng = np.random.default_rng(3)
    chosen = [rng.integers(3, 1000, length) for length in (12, 7, 20)]
    rejected = [rng.integers(3, 1000, length) for length in (9, 15, 20)]
    prompts = np.array([4, 2, 5])
    batch = pack_pairs(chosen, rejected, prompts, 64, 0, "bfd")

    def weighted(sequence: np.ndarray, prompt: int, shared: int) -> float:
        ids = torch.from_numpy(sequence).long()[None]
        logps = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1).gather(1, ids[0, 1:, None])[prompt - 1:, 0]
        return float(logps[:shared].sum() + 0.3 * logps[shared:].sum())
    with torch.no_grad():
        logps, tokens, *_ = pair_logps(model, batch, torch.device("cpu"), ld_alpha=0.3)
        expected = [[weighted(c, p, min(len(c), len(r)) - p), weighted(r, p, min(len(c), len(r)) - p)]
                    for c, r, p in zip(chosen, rejected, prompts)]
    torch.testing.assert_close(logps, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert tokens.tolist() == [[len(c) - p, len(r) - p] for c, r, p in zip(chosen, rejected, prompts)]


def test_token_statistics_of_packed_pairs_are_each_sequence_alone(model):
    """TRL's token metrics' sums (the policy's entropy, the logits' mean over the vocabulary, the target ranked first)
    over each sequence's completion tokens: the same packed as alone, computed in chunks of fewer tokens than a row."""
    rng = np.random.default_rng(5)
    chosen = [rng.integers(3, 1000, length) for length in (12, 7, 20)]
    rejected = [rng.integers(3, 1000, length) for length in (9, 15, 20)]
    with torch.no_grad():
        for position in range(6, 10):  # tokens the model ranks first, so that the count is tested, not only its zero
            logits = model(input_ids=torch.from_numpy(chosen[0][:position])[None]).logits
            chosen[0][position] = int(logits[0, -1].argmax())
    prompts = np.array([4, 2, 5])
    batch = pack_pairs(chosen, rejected, prompts, 64, 0, "bfd")

    def alone(sequence: np.ndarray, prompt: int) -> list[float]:
        ids = torch.from_numpy(sequence).long()[None]
        logits = model(input_ids=ids).logits[0, :-1].double()[prompt - 1:]
        entropy = torch.distributions.Categorical(logits=logits).entropy()
        hits = logits.argmax(-1) == ids[0, prompt:]
        return [float(entropy.sum()), float(logits.mean(-1).sum()), float(hits.sum())]
    with torch.no_grad(), patch("training.objectives.dpo.loss.DPO_CHUNK_TOKENS", 5):
        statistics = pair_logps(model, batch, torch.device("cpu"), statistics=True).statistics
        expected = torch.tensor([[alone(c, p), alone(r, p)] for c, r, p in zip(chosen, rejected, prompts)])
    torch.testing.assert_close(statistics, expected.float(), rtol=1e-5, atol=1e-4)
    assert statistics[0, 0, 2] >= 4


def test_wpo_weights_packed_pairs_as_each_sequence_alone(model):
    """use_weighting (WPO, TRL's): each sequence's weight is exp(mean over its completion tokens of log p(token) -
    log sum_v p(v)^2), the same packed as alone and unmoved by ld_alpha; a pair's loss is multiplied by its two."""
    rng = np.random.default_rng(4)
    chosen = [rng.integers(3, 1000, length) for length in (12, 7, 20)]
    rejected = [rng.integers(3, 1000, length) for length in (9, 15, 20)]
    prompts = np.array([4, 2, 5])
    batch = pack_pairs(chosen, rejected, prompts, 64, 0, "bfd")

    def weight(sequence: np.ndarray, prompt: int) -> float:
        ids = torch.from_numpy(sequence).long()[None]
        logps = model(input_ids=ids).logits[0, :-1].double().log_softmax(-1)[prompt - 1:]
        aligned = logps.gather(1, ids[0, prompt:, None])[:, 0] - (2 * logps).logsumexp(-1)
        return math.exp(float(aligned.mean()))
    with torch.no_grad():
        logps, _, _, weights = pair_logps(model, batch, torch.device("cpu"), ld_alpha=0.3, statistics=True,
                                          weighting=True)
        expected = torch.tensor([[weight(c, p), weight(r, p)] for c, r, p in zip(chosen, rejected, prompts)])
    torch.testing.assert_close(weights, expected.float(), rtol=1e-5, atol=0)
    assert not weights.requires_grad and pair_logps(model, batch, torch.device("cpu"), statistics=True).weights is None
    reference = logps - 0.5
    plain, _ = pair_losses(logps, reference, torch.ones(3, 2), DpoSection(loss=["sigmoid", "hinge"]))
    weighted, _ = pair_losses(logps, reference, torch.ones(3, 2), DpoSection(loss=["sigmoid", "hinge"]), weights)
    torch.testing.assert_close(weighted, plain * weights[:, 0] * weights[:, 1])


def test_aot_sorts_the_real_pairs_of_the_micro_batch():
    """aot: the sorted policy margins against the sorted reference margins; aot_unpaired: the sorted chosen log-ratios
    against the sorted rejected ones; each position's difference in the label-smoothed sigmoid loss. A padding pair
    (real false, a copy of the last) takes no part in the sort and no loss."""
    policy = torch.tensor([[-10.0, -12.0], [-5.0, -4.0], [-7.0, -9.5], [-7.0, -9.5]])
    reference = torch.tensor([[-11.0, -11.0], [-5.5, -5.0], [-7.0, -8.0], [-7.0, -8.0]])
    real = torch.tensor([True, True, True, False])
    section = DpoSection(loss=["aot", "aot_unpaired"], loss_weights=[1.0, 0.5], beta=0.5, label_smoothing=0.1)

    def smoothed(delta: list[float]) -> torch.Tensor:
        margin = 0.5 * torch.tensor(delta)
        return -F.logsigmoid(margin) * 0.9 - F.logsigmoid(-margin) * 0.1
    # policy margins 2, -1, 2.5 sorted: -1, 2, 2.5; reference margins 0, -0.5, 1 sorted: -0.5, 0, 1
    aot = smoothed([-1 - -0.5, 2 - 0, 2.5 - 1])
    # chosen log-ratios 1, 0.5, 0 sorted: 0, 0.5, 1; rejected -1, 1, -1.5 sorted: -1.5, -1, 1
    unpaired = smoothed([0 - -1.5, 0.5 - -1, 1 - 1])
    losses, _ = pair_losses(policy, reference, torch.ones(4, 2), section, real=real)
    torch.testing.assert_close(losses, torch.cat([aot + 0.5 * unpaired, torch.zeros(1)]))
    with pytest.raises(ConfigError, match="dpo.use_weighting with aot or aot_unpaired"):
        load_recipe("tiny_llama_dpo", ["dpo.loss=aot", "dpo.use_weighting=true"])


def test_a_resume_with_another_ld_alpha_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(reference_logps, "fingerprint", lambda rows: "the pairs")
    batches = SimpleNamespace(rows=[0, 1])
    path = tmp_path / "reference_logps.npz"
    np.savez(path, data=np.array("the pairs"), ld_alpha=np.array(reference_logps.ld_key(0.5)), train=np.zeros((2, 2)))
    assert set(reference_logps.read_reference(path, batches, 0.5)) == {"train"}
    with pytest.raises(ConfigError, match="summed with dpo.ld_alpha=0.5, not null: resume with the ld_alpha"):
        reference_logps.read_reference(path, batches, None)
    np.savez(path, data=np.array("the pairs"), train=np.zeros((2, 2)))  # written before ld_alpha: none
    with pytest.raises(ConfigError, match="summed with dpo.ld_alpha=null, not 0.5"):
        reference_logps.read_reference(path, batches, 0.5)


def test_sigmoid_loss_is_dpo_and_starts_at_log_2():
    policy, reference = torch.tensor([[-10.0, -12.0], [-5.0, -4.0]]), torch.tensor([[-11.0, -11.0], [-5.0, -5.0]])
    losses, rewards = pair_losses(policy, reference, torch.ones(2, 2), DpoSection(beta=0.5))
    margins = 0.5 * torch.tensor([(1.0 - -1.0), (0.0 - 1.0)])
    torch.testing.assert_close(losses, -torch.nn.functional.logsigmoid(margins))
    torch.testing.assert_close(rewards, 0.5 * (policy - reference))
    start = pair_losses(reference, reference, torch.ones(2, 2), DpoSection())[0]
    torch.testing.assert_close(start, torch.full((2,), math.log(2)))


def test_ipo_loss_uses_per_token_mean_log_ratios():
    policy, reference = torch.tensor([[-10.0, -12.0]]), torch.tensor([[-11.0, -11.0]])
    tokens = torch.tensor([[4.0, 2.0]])
    losses, _ = pair_losses(policy, reference, tokens, DpoSection(beta=0.1, loss="ipo"))
    torch.testing.assert_close(losses, torch.tensor([(1 / 4 - -1 / 2 - 1 / (2 * 0.1)) ** 2]))


EPS = 0.1
AT_THE_START = {  # each loss type's value where the policy is still the reference (every log-ratio 0), beta 0.1
    "sigmoid": math.log(2), "hinge": 1.0, "ipo": 5.0 ** 2, "sigmoid_norm": math.log(2), "robust": math.log(2),
    "exo_pair": 0.5 * (math.log(0.5) - math.log(1 - EPS)) + 0.5 * (math.log(0.5) - math.log(EPS)),
    "nca_pair": 2 * math.log(2), "bco_pair": 2 * math.log(2), "sppo_hard": 2 * 5.0 ** 2, "apo_zero": 1.0,
    "apo_down": 1.0, "discopop": 0.5 * math.log(2) + 0.5}


@pytest.mark.parametrize("loss", AT_THE_START)
def test_each_loss_type_starts_where_its_formula_does(loss):
    reference = torch.tensor([[-11.0, -9.0], [-5.0, -5.0]])
    losses, _ = pair_losses(reference, reference, torch.full((2, 2), 3.0),
                            DpoSection(loss=loss, label_smoothing=EPS if loss in ("robust", "exo_pair") else 0.0))
    torch.testing.assert_close(losses, torch.full((2,), AT_THE_START[loss]))


def test_several_losses_are_summed_by_their_weights_and_named_so():
    policy, reference = torch.tensor([[-10.0, -12.0], [-5.0, -4.0]]), torch.tensor([[-11.0, -11.0], [-5.0, -5.0]])
    tokens = torch.tensor([[4.0, 2.0], [3.0, 5.0]])
    alone = {name: pair_losses(policy, reference, tokens, DpoSection(loss=name))[0] for name in ("sigmoid", "bco_pair")}
    mixed, _ = pair_losses(policy, reference, tokens, DpoSection(loss=["sigmoid", "bco_pair"], loss_weights=[0.8, 0.2]))
    torch.testing.assert_close(mixed, 0.8 * alone["sigmoid"] + 0.2 * alone["bco_pair"])
    assert described_loss(DpoSection(loss=["sigmoid", "bco_pair"], loss_weights=[0.8, 0.2])) == \
        "0.8 x sigmoid + 0.2 x bco_pair"
    assert described_loss(DpoSection(loss="ipo")) == "ipo"


@pytest.mark.parametrize("kind, expected", [
    ("reverse_kl", 1.0), ("forward_kl", 1 - math.exp(-1)), ("js_divergence", math.log(2) - math.log1p(math.exp(-1))),
    ("alpha_divergence", 2 * (1 - math.exp(-0.5))),  # alpha 0.5: (exp((alpha - 1) u) - 1) / (alpha - 1)
])
def test_an_f_divergence_turns_a_log_ratio_into_its_score(kind, expected):
    scores = f_divergence_scores(torch.tensor([[1.0, 0.0]]), DpoSection(f_divergence_type=kind))
    torch.testing.assert_close(scores, torch.tensor([[expected, 0.0]]))


@pytest.mark.parametrize("override, expected", [
    ("dpo.loss=[sigmoid,bco_pair]", None),
    ("dpo.f_divergence_type=forward_kl dpo.loss=[sigmoid,nca_pair]",
     "dpo.f_divergence_type=forward_kl changes the losses of the reward difference .*, not nca_pair"),
    ("dpo.loss_weights=[1.0,2.0]", "dpo.loss_weights has 2 weights for the 1 losses of dpo.loss=\\['sigmoid'\\]"),
    ("dpo.loss=exo_pair", "dpo.loss=exo_pair takes dpo.label_smoothing above 0"),
    ("dpo.loss=[]", "dpo.loss=\\[\\] names no loss"),
    ("dpo.loss=kto", "dpo.loss.0: Input should be 'sigmoid', 'hinge', "),
    ("dpo.label_smoothing=0.5", "dpo.label_smoothing"),
    ("dpo.use_weighting=true dpo.loss=[sigmoid,sft]", "dpo.use_weighting with dpo.loss sft: WPO's weights are the "
                                                      "policy's"),
])
def test_the_loss_settings_are_checked_when_the_recipe_loads(override, expected):
    if expected is None:
        assert load_recipe("tiny_llama_dpo", [override]).dpo.losses == [("sigmoid", 1.0), ("bco_pair", 1.0)]
        return
    with pytest.raises(ConfigError, match=expected):
        load_recipe("tiny_llama_dpo", override.split())


@pytest.mark.parametrize("override, expected", [
    ("data.packing=concat", "use bfd .* or none"),
    ("data.long_documents=split", "use truncate or drop"),
    ("long_context.logits_tile_tokens=1024", "logits_tile_tokens"),
    ("dpo.sync_ref_model=true lora.enabled=true", "dpo.sync_ref_model with lora: the reference is the base"),
    ("dpo.sync_ref_model=true model.name_or_path=null model.config=recipes/tiny_llama/config.json "
     "tokenizer.name_or_path=recipes/tiny_llama/tokenizer",
     "dpo.sync_ref_model from model.config alone"),
])
def test_dpo_refuses_what_it_cannot_do_and_says_why(override, expected):
    """Before anything is built: train.py's checks, and `python -m data_pipeline` (with no model config)."""
    with pytest.raises(ConfigError, match=expected):
        Dpo.check(load_recipe("tiny_llama_dpo", override.split()), None)


@pytest.mark.parametrize("config, held", [("zero2", 1.0), ("zero3", 0.5)])
def test_the_plan_holds_tr_dpos_reference_and_saves_it_with_each_checkpoint(tmp_path, config, held):
    """dpo.sync_ref_model: the reference model, whole on each rank at ZeRO 0-2 and half of it on each of 2 ranks at
    ZeRO-3, in the model states; each checkpoint holds it whole (reference.safetensors), and the dry run says so."""
    import train
    from training.planning.checkpoint_size import planned_checkpoint
    from training.planning.memory import planned_model_states
    save_small_checkpoint(tmp_path / "base")

    def plan(*overrides):
        args = train.parse_args(["--recipe", "tiny_llama_dpo", "--dry-run", f"model.name_or_path={tmp_path / 'base'}",
                                 "precision=bf16", f"deepspeed.config={config}", *overrides])
        return train.make_plan(args, world_size=2)

    synced, stored = plan("dpo.sync_ref_model=true"), plan()
    whole = stored.shape.parameters * 2  # bf16 at ZeRO 1-3
    assert planned_model_states(synced).device_bytes - planned_model_states(stored).device_bytes == whole * held
    assert planned_checkpoint(synced).total - planned_checkpoint(stored).total == whole
    assert "synced to the policy every 512 steps (alpha 0.6)" in "\n".join(Dpo.describe(synced))


@pytest.mark.parametrize("lora", [False, True])
def test_the_dry_run_shows_the_batch_in_pairs_and_what_the_reference_costs(lora, tmp_path, capsys):
    import train
    save_small_checkpoint(tmp_path / "base")
    assert train.main(["--recipe", "tiny_llama_dpo", "--dry-run", "--output-dir", str(tmp_path / "out"),
                       f"model.name_or_path={tmp_path / 'base'}", f"lora.enabled={lora}"]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    recipe = load_recipe("tiny_llama_dpo")
    assert f"batch: {recipe.training.micro_batch_size} pairs/rank" in out and "rows/rank" not in out
    assert f"DPO: loss {recipe.dpo.loss[0]}, beta {recipe.dpo.beta:g}; reference: " \
           + ("the base with the adapters disabled" if lora else "the starting model") in out
