"""training/objectives/distill/loss.py: the student's distilling forward gives TRL's generalized JSD of the two models'
logits over the target tokens (GKDTrainer.generalized_jsd_loss, on the whole logits), and its gradient, at every
beta and temperature; with the next-token loss beside it, and for heads of padded vocabularies."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
from trl.experimental.gkd import GKDTrainer

from tests.conftest import REPO
from training.objectives.distill.loss import Logits, Teacher, distilling, target_mask


def tiny(seed: int, **shape) -> torch.nn.Module:
    """A tiny_llama-like model with seeded weights whose head is large enough for peaked distributions."""
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", **{
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 96, "tie_word_embeddings": False, **shape})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def rows() -> dict:
    """Two packed rows of 12 tokens: prompts without targets, completions with them, two documents in the second."""
    torch.manual_seed(3)
    input_ids = torch.randint(0, 96, (2, 12))
    labels = input_ids.clone()
    labels[0, :5] = -100
    labels[1, :3] = -100
    labels[1, 7:9] = -100
    position_ids = torch.tensor([list(range(12)), [*range(7), *range(5)]])
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def trl_loss(student, teacher, batch, beta, temperature):
    """GKDTrainer's compute_loss on the whole logits, with the temperature DistillationTrainer applies."""
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    student_logits = student(**kwargs).logits[:, :-1]
    with torch.no_grad():
        teacher_logits = teacher(**kwargs).logits[:, :-1]
    vocab = min(student_logits.shape[-1], teacher_logits.shape[-1])
    return GKDTrainer.generalized_jsd_loss(student_logits[..., :vocab], teacher_logits[..., :vocab],
                                           labels=batch["labels"][:, 1:], beta=beta, temperature=temperature)


def distilled_loss(student, teacher, batch, beta, temperature, lm_loss_weight=0.0):
    taken = target_mask(batch["labels"])
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    with torch.no_grad():  # as the run's teacher (teacher.py)
        hidden = teacher(**kwargs, hidden_only=True).reshape(-1, teacher.config.hidden_size)[taken]
    states = Teacher(hidden, teacher.lm_head.weight, Logits.of(teacher.config), beta, temperature, lm_loss_weight)
    return student(**kwargs, labels=batch["labels"], teacher=states)


def gradients(model):
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.1, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_the_chunked_divergence_is_trls_generalized_jsd_and_its_gradient(beta, temperature):
    """The token mean over the target tokens, and every student weight's gradient, equal TRL's on the whole logits
    (fp32)."""
    student, teacher, batch = tiny(1), tiny(2, hidden_size=48, head_dim=12), rows()
    expected = trl_loss(student, teacher, batch, beta, temperature)
    expected.backward()
    expected_grads = gradients(student)
    student.zero_grad()
    distilling(student)
    distilling(teacher)
    output = distilled_loss(student, teacher, batch, beta, temperature)
    output.loss.backward()
    assert expected.item() > 1e-3  # distributions far enough apart for the comparison to mean something
    torch.testing.assert_close(output.loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(output.divergence / int(target_mask(batch["labels"]).sum()), expected)
    for name, grad in gradients(student).items():
        scale = expected_grads[name].abs().max().item()  # fp32 rounding: relative to the largest entry
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5 * scale)


def test_the_next_token_loss_adds_its_weight_times_the_models_own():
    student, teacher, batch = tiny(1), tiny(2), rows()
    expected = trl_loss(student, teacher, batch, 0.5, 1.0) + 0.3 * student(**batch).loss
    distilling(student)
    distilling(teacher)
    output = distilled_loss(student, teacher, batch, 0.5, 1.0, lm_loss_weight=0.3)
    torch.testing.assert_close(output.loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(output.next_token / int(target_mask(batch["labels"]).sum()), student(**batch).loss)


def test_a_padded_vocabulary_compares_the_rows_both_heads_have():
    """A teacher whose head has rows past the student's (a padded vocabulary: Qwen2.5's 7B beside its 0.5B) is read
    over the student's rows alone, as TRL's loss over the logits cut to them."""
    student, teacher, batch = tiny(1), tiny(2, vocab_size=128), rows()
    expected = trl_loss(student, teacher, batch, 0.5, 0.9)
    distilling(student)
    distilling(teacher)
    torch.testing.assert_close(distilled_loss(student, teacher, batch, 0.5, 0.9).loss, expected, rtol=1e-5, atol=1e-7)


def test_without_a_teacher_each_forward_is_the_models_own():
    model, batch = tiny(1), rows()
    expected = model(**batch)
    distilling(model)
    output = model(**batch)
    torch.testing.assert_close(output.loss, expected.loss)
    torch.testing.assert_close(output.logits, expected.logits)
    hidden = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], hidden_only=True)
    torch.testing.assert_close(F.linear(hidden, model.lm_head.weight), expected.logits)


def test_a_lora_student_distills_through_its_adapters():
    """peft's model around the student (distilling patched on the model inside it, as the run does): the loss and
    the adapters' gradients are TRL's on the whole logits; the frozen head takes none."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    student, teacher, batch = get_peft_model(tiny(1), config), tiny(2), rows()
    expected = trl_loss(student, teacher, batch, 0.5, 0.9)
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.requires_grad}
    student.zero_grad()
    distilling(student.get_base_model())
    distilling(teacher)
    output = distilled_loss(student, teacher, batch, 0.5, 0.9)
    output.loss.backward()
    torch.testing.assert_close(output.loss, expected, rtol=1e-5, atol=1e-7)
    for name, parameter in student.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-4,
                                       atol=1e-5 * expected_grads[name].abs().max().item())
    assert student.get_base_model().lm_head.weight.grad is None
