"""The LM head and cross-entropy fused, in chunks of tokens (`fused_loss`, on by default for training.objective=lm).

transformers computes the head's logits for every token of the micro-batch, [tokens, vocab], casts them to fp32 and
keeps that copy for the loss's backward pass: for a 128k vocabulary and 8,192 tokens, 4.2 GB of fp32 logits besides
their 2.1 GB in bf16, and as much again for their gradient. Here the head and the loss run on one chunk of tokens
at a time, and each chunk's gradients (with respect to the hidden states and to the head's weight) are taken in the
forward pass, as Liger-Kernel's fused linear cross-entropy does: softmax minus the one-hot target is the gradient of
the summed token loss with respect to the logits. Only those gradients are kept for the backward pass, which scales
them by the gradient arriving at the loss (the 1 / num_items_in_batch, accumulation and loss scale DeepSpeed apply).
No logits are recomputed, and at most one chunk's exist.

The values are transformers' own: the same logits (the head's matmul in the run's dtype, its rows cut into chunks),
the same fp32 log-softmax, the summed token loss over num_items_in_batch with labels shifted (or shift_labels, under
sequence parallelism, as given). Under ZeRO-3 the head is called as a module, so DeepSpeed gathers its weight there
as for any layer. Without labels, or without gradients needed (evaluation), nothing changes but that no gradient
is taken.
"""
from functools import cache

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from training.compat.torch import replace_forward
from training.planning.kernels import CHUNK_TOKENS

IGNORE = -100
class LinearCrossEntropy(torch.autograd.Function):
    """sum over targets of cross_entropy(hidden @ weight.T), the gradients taken chunk by chunk in the forward pass."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[:2]  # a frozen head (LoRA) takes no weight gradient
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], CHUNK_TOKENS):
            rows = slice(start, start + CHUNK_TOKENS)
            chunk_loss, grad_logits = loss_and_logits_grad(hidden[rows] @ weight.T, targets[rows])
            loss += chunk_loss
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                grad_weight.add_(grad_logits.T @ hidden[rows])  # the chunks' sum in fp32, each product rounded once
        ctx.grad_hidden, ctx.grad_weight = grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        scaled = [None if grad is None else grad.mul_(grad_loss.to(grad.dtype)) for grad in (ctx.grad_hidden,
                                                                                             ctx.grad_weight)]
        ctx.grad_hidden = ctx.grad_weight = None
        return *scaled, None


def loss_and_logits_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's summed token loss (from the fp32 log-softmax, as transformers takes it) and its gradient with respect
    to the logits, in the logits' dtype: on CUDA compiled into two passes over the logits, elsewhere eager."""
    return (compiled_loss_and_logits_grad() if logits.is_cuda else token_loss_and_logits_grad)(logits, targets)


def token_loss_and_logits_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient is made in place of the fp32 logits (fp32 logits, the chunk's and used once, are overwritten), and
    the exponentials are taken once, for the log-sum-exp and the softmax both: on a CPU, where this function is most
    of a small model's step, that is 2.5 times faster than logsumexp and exp apart."""
    logits32 = logits.float()
    taken = targets != IGNORE
    safe_targets = torch.where(taken, targets, 0)[:, None]
    target_logits = logits32.gather(1, safe_targets)
    peak = logits32.amax(dim=-1, keepdim=True)
    exps = logits32.sub_(peak).exp_()
    total = exps.sum(dim=-1, keepdim=True)
    loss = ((peak + total.log() - target_logits).squeeze(1) * taken).sum()  # log-sum-exp minus the target's logit
    grad = exps.div_(total)  # the softmax, minus the one-hot target: the summed loss's gradient
    grad.scatter_add_(1, safe_targets, torch.full_like(safe_targets, -1, dtype=grad.dtype))
    return loss, grad.mul_(taken[:, None]).to(logits.dtype)


@cache
def compiled_loss_and_logits_grad():
    return torch.compile(token_loss_and_logits_grad, dynamic=False)


def summed_token_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of hidden @ weight.T against targets (IGNORE: no loss), fused when a gradient is
    needed, else chunked only."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(hidden, weight, targets)
    return sum(F.cross_entropy((hidden[start:start + CHUNK_TOKENS] @ weight.T).float(),
                               targets[start:start + CHUNK_TOKENS], ignore_index=IGNORE, reduction="sum")
               for start in range(0, hidden.shape[0], CHUNK_TOKENS))


def fuse_head_and_loss(model: PreTrainedModel) -> None:
    """The causal LM's forward with labels returns its loss (no logits) from the fused head and loss; without
    labels it is the model's own forward (generation, logits for comparison and export)."""
    own_forward, head = model.forward, model.get_output_embeddings()

    def head_forward(self, hidden_states: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return F.linear(hidden_states, self.weight, self.bias)
        assert self.bias is None, "fused_loss: an LM head with a bias"  # none of transformers' causal LMs has one
        return summed_token_loss(hidden_states.reshape(-1, hidden_states.shape[-1]), self.weight, targets.reshape(-1))

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: float | torch.Tensor | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        if labels is None:
            return own_forward(input_ids=input_ids, **kwargs)
        hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        if shift_labels is None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        loss_sum = head(hidden, shift_labels)  # through the module: ZeRO-3 gathers its weight
        targets = num_items_in_batch if num_items_in_batch is not None else (shift_labels != IGNORE).sum()
        return CausalLMOutputWithPast(loss=loss_sum / targets)

    replace_forward(head, head_forward)
    replace_forward(model, forward)
