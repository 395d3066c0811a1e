"""distill's loss: TRL's generalized Jensen-Shannon divergence between the student's and the teacher's next-token
distributions at each target token (a chat's completion tokens, every token of a document), from both models' final
hidden states through their heads, a tile of tokens and vocabulary entries at a time (TRL's chunked divergence,
training/compat/trl.py): neither model's logits exist whole, in any dtype.

Both causal LMs get a forward (`distilling`) that, asked for the hidden states (`hidden_only`), returns the final
norm's output and no logits; and the student's, given a `Teacher`, returns the sums the loss takes: the divergence
over the target tokens, the student's entropy there, and its next-token loss (distill.lm_loss_weight; through the
fused head and loss, training/models/fused_loss.py). The student's head is called as a module with the teacher's
states, so that ZeRO-3 gathers its weight there, in the forward pass and again in the backward, as for any layer; the
teacher's head is read whole (training/objectives/distill/teacher.py). Without either argument each forward is the
model's own (the evaluation's loss, generation, export)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from training.compat.torch import replace_forward
from training.compat.trl import chunked_divergence
from training.models.fused_loss import IGNORE, summed_token_loss


@dataclass(frozen=True)
class Logits:
    """How a model's logits are made from its head's output, as transformers' modeling code makes them: scaled
    (Cohere's logit_scale), then soft-capped (Gemma 2's final_logit_softcapping)."""
    scale: float = 1.0
    softcap: float | None = None

    @staticmethod
    def of(config) -> "Logits":
        return Logits(getattr(config, "logit_scale", None) or 1.0, getattr(config, "final_logit_softcapping", None))


@dataclass(frozen=True)
class Teacher:
    """The teacher's side of a micro-batch: its hidden states at the student's target tokens [targets, its hidden
    size] and its head's weight [vocabulary, its hidden size], whole."""
    hidden: torch.Tensor
    head_weight: torch.Tensor
    logits: Logits
    beta: float
    temperature: float
    lm_loss_weight: float


@dataclass
class DistillOutput(CausalLMOutputWithPast):
    """The student's forward with a teacher: `loss` is the divergence summed over the target tokens plus
    lm_loss_weight x the next-token loss summed over them, divided by num_items_in_batch; and the sums apart."""
    divergence: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    next_token: torch.Tensor | None = None


def target_mask(labels: torch.Tensor) -> torch.Tensor:
    """The tokens whose next token is a target, flat: the place each loss is taken at (labels shifted, as
    transformers shifts them)."""
    return (F.pad(labels[:, 1:], (0, 1), value=IGNORE) != IGNORE).reshape(-1)


def distilling(model: PreTrainedModel) -> None:
    """The forward passes above on the causal LM (the student's, before or after LoRA wraps it; the teacher's)."""
    own_forward, head = model.forward, model.get_output_embeddings()
    own_head_forward, logits = head.forward, Logits.of(model.config)

    def head_forward(self, hidden_states: torch.Tensor, teacher: Teacher | None = None,
                     targets: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | torch.Tensor:
        if teacher is None:
            return own_head_forward(hidden_states)
        vocab = min(self.weight.shape[0], teacher.head_weight.shape[0])  # a padded vocabulary's rows are no tokens
        divergence, entropy = chunked_divergence(
            hidden_states, self.weight[:vocab], teacher.hidden, teacher.head_weight[:vocab], teacher.beta,
            teacher.temperature, logits.scale, logits.softcap, teacher.logits.scale, teacher.logits.softcap)
        next_token = (summed_token_loss(hidden_states, self.weight, targets) if teacher.lm_loss_weight
                      else torch.zeros((), device=hidden_states.device))
        return divergence.sum(), entropy.sum(), next_token

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                teacher: Teacher | None = None, hidden_only: bool = False,
                num_items_in_batch: float | torch.Tensor | None = None, **kwargs):
        if teacher is None and not hidden_only:
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return own_forward(input_ids=input_ids, labels=labels, **kwargs)
        hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        if hidden_only:
            return hidden
        taken = target_mask(labels)
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE).reshape(-1)[taken]
        divergence, entropy, next_token = head(hidden.reshape(-1, hidden.shape[-1])[taken], teacher, targets)
        total = divergence + teacher.lm_loss_weight * next_token
        return DistillOutput(loss=total / (num_items_in_batch or max(int(taken.sum()), 1)), divergence=divergence,
                             entropy=entropy, next_token=next_token)

    replace_forward(head, head_forward)
    replace_forward(model, forward)
