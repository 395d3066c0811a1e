"""training.objective=dpo before anything is built: its recipe section (TRL's DPOConfig names) and traits."""
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field, PositiveFloat, PositiveInt, model_validator

from training.base.schema import StrictModel
from training.objectives.spec import TRL_SHARED_NAMES, ObjectiveSpec

DpoLoss = Literal["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop", "sigmoid_norm", "aot", "aot_unpaired", "sft"]
SORTED_LOSSES = {"aot", "aot_unpaired"}  # over a micro-batch's pairs, sorted


F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}


class DpoSection(StrictModel):
    """training.objective=dpo (training/objectives/dpo/): the preference loss against a frozen reference, the
    starting model (its log-probabilities computed once, before step 1) or, with LoRA, the base without adapters."""
    beta: PositiveFloat = 0.1  # how far the policy may move from the reference: the log-ratios' scale in the loss
    loss: Annotated[list[DpoLoss], BeforeValidator(lambda value: [value] if isinstance(value, str) else value)] = \
        ["sigmoid"]  # TRL's loss_type names (docs/dpo.md, the formulas), one or a list: their sum, weighted by
    # loss_weights (MPO's mix, for one)
    loss_weights: list[float] | None = None  # one per loss (default: 1 each)
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)  # robust: the chance a label is flipped; exo_pair: epsilon
    discopop_tau: PositiveFloat = 0.05  # discopop: the temperature of its blend of the logistic and exponential losses
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"  # f-DPO:
    # the regularizer towards the reference (reverse KL: DPO's own), for the losses of the reward difference
    f_alpha_divergence_coef: float = 0.5  # alpha_divergence's alpha
    ld_alpha: float | None = Field(None, ge=0.0, le=1.0)  # LD-DPO: the weight of the tokens past the shorter completion
    # of the pair, in the policy's and the reference's log-probabilities (None or 1: none; 0: only the shared length)
    use_weighting: bool = False  # WPO: each pair's loss times its two sequences' weights, the policy's mean over the
    # tokens of log p(token) - log sum p(v)^2, exponentiated, without a gradient (training/objectives/dpo/)
    sync_ref_model: bool = False  # TR-DPO: the reference is a model of its own, run beside each step, and every
    # ref_model_sync_steps steps becomes ref_model_mixup_alpha x the policy + (1 - alpha) x itself (a full fine-tune;
    # saved with each checkpoint)
    ref_model_mixup_alpha: float = Field(0.6, gt=0, le=1)
    ref_model_sync_steps: PositiveInt = 512
    disable_dropout: bool = True  # the model's dropout off (TRL's default for DPO): the policy's log-probabilities
    # then compare with the reference's, computed without it (training/models/model.py, disable_dropout)
    trl_names: ClassVar[dict[str, str]] = {  # DPOConfig's, for the unknown-key error: where they live here
        "loss_type": "write dpo.loss (a name or a list of TRL's loss types)",
        "max_length": "write data.seq_len",
        "truncation_mode": "write data.long_documents (truncate keeps the start, or drop)",
        "padding_free": "write data.packing (bfd packs the pairs' sequences whole)",
        "precompute_ref_log_probs": "the reference is always precomputed without LoRA (a pass before step 1, "
                                    "reference_logps.npz)",
        "precompute_ref_batch_size": "the reference pass runs in the training layout's micro-batches "
                                     "(training.micro_batch_size)",
        "dataset_num_proc": "write data.num_proc",
        "activation_offloading": "write long_context.offload_checkpoints (with activation_checkpointing: true)",
        "pad_token": "the tokenizer's pad token is used, else its EOS (tokenizer.name_or_path names the tokenizer)",
        **TRL_SHARED_NAMES,
    }

    @property
    def losses(self) -> list[tuple[str, float]]:
        """(loss, weight) of each loss the pair loss sums."""
        return list(zip(self.loss, self.loss_weights or [1.0] * len(self.loss), strict=True))

    @model_validator(mode="after")
    def weights_and_smoothing_fit_the_losses(self) -> "DpoSection":
        names = self.loss
        if not names:
            raise ValueError("dpo.loss=[] names no loss: give one of TRL's loss_type names, e.g. sigmoid")
        if self.loss_weights is not None and len(self.loss_weights) != len(names):
            raise ValueError(f"dpo.loss_weights has {len(self.loss_weights)} weights for the {len(names)} losses of "
                             f"dpo.loss={names}: give one weight per loss")
        other = sorted(set(names) - F_DIVERGENCE_LOSSES)
        if self.f_divergence_type != "reverse_kl" and other:
            raise ValueError(f"dpo.f_divergence_type={self.f_divergence_type} changes the losses of the reward "
                             f"difference ({', '.join(sorted(F_DIVERGENCE_LOSSES))}), not {', '.join(other)}: use "
                             f"reverse_kl with those")
        if self.use_weighting and SORTED_LOSSES & set(names):
            raise ValueError("dpo.use_weighting with aot or aot_unpaired: their losses belong to sorted positions, "
                             "not to pairs, which WPO weighs (TRL refuses it alike)")
        if self.use_weighting and "sft" in names:
            raise ValueError("dpo.use_weighting with dpo.loss sft: WPO's weights are the policy's, known only in each "
                             "micro-batch's forward pass, and the sft term is a mean over the global batch's chosen "
                             "tokens; weight the pair losses alone (drop sft), or use_weighting=false")
        if "exo_pair" in names and self.label_smoothing == 0:
            raise ValueError("dpo.loss=exo_pair takes dpo.label_smoothing above 0 (its epsilon, the log of which it "
                             "takes; the EXO paper's is 1e-3)")
        return self


REFERENCE_FILE = "reference_logps.npz"  # in the output folder: the reference's log-probabilities
# (training/objectives/dpo/reference_logps.py), read again on --resume

DPO_CHUNK_TOKENS = 512  # the token statistics and WPO weights (loss.py), without a gradient: 12 bytes per token and
# vocabulary entry live (the fp32 logits, and each logsumexp's), 0.8 GB for a 128k vocabulary
REFUSED_LAYOUTS = {  # the parallel degrees DPO does not run with (training/parallel/support.py)
    "pipeline_stages": "the pipeline's last stage would need each pair's sequences and reference values",
    "tensor_parallel": "not built",
    "sequence_parallel": "the loss is a function of each sequence's whole log-probability, which sequence "
                         "parallelism splits across ranks",
    "expert_parallel": "not built",
}

DPO = ObjectiveSpec(name="dpo", runtime="training.objectives.dpo.objective:Dpo", trains_on="preference pairs",
                    model_loss=False, rows_per_example=2, unit="pairs", examples="pairs",
                    statistics_chunk_tokens=DPO_CHUNK_TOKENS, memory="training.objectives.dpo.memory:dpo_memory",
                    run_files=(REFERENCE_FILE,),
                    settings=DpoSection, refused_layouts=REFUSED_LAYOUTS)
