"""Recipes: a typed schema (pydantic, unknown keys rejected) loaded from YAML plus `key.path=value` overrides.

Every problem is reported at once, naming the file or override, the key and the fix, before
anything expensive starts.
"""
import difflib
import math
import re
import typing
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, Field, NonNegativeFloat, NonNegativeInt,
                      PositiveFloat, PositiveInt, PrivateAttr, ValidationError, ValidationInfo, WrapValidator,
                      model_validator)

from data_pipeline.config import DataConfig, Examples, LocalPath, matching_files, prepared_examples
from training.base.schema import StrictModel
from training.base.errors import ConfigError, read_text

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def local_path_or_hub_id(value: str, info: ValidationInfo) -> str:
    """A folder that exists relative to the recipe (or absolute), or a value written as a path (starting
    with `.`, `/` or `~`), becomes an absolute path; anything else is kept as written, as a Hugging Face
    hub id such as `meta-llama/Llama-2-7b-hf`."""
    base_dir = Path((info.context or {}).get("base_dir", "."))
    candidate = (base_dir / Path(value).expanduser())
    written_as_path = value.startswith((".", "/", "~"))  # a missing one is reported by the checks before a run
    return str(candidate.resolve()) if candidate.exists() or written_as_path else value


HubIdOrPath = Annotated[str, AfterValidator(local_path_or_hub_id)]


def finite_numbers(tree: Any) -> Any:
    """A free-form mapping (passed on to transformers or DeepSpeed) holds no .inf or .nan."""
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else [tree]
    for value in values:
        if isinstance(value, (dict, list)):
            finite_numbers(value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
    return tree


FreeForm = Annotated[dict[str, Any], AfterValidator(finite_numbers)]


def regular_expression(value: list[str] | str) -> list[str] | str:
    """lora.target_modules as a string other than all-linear is a regular expression over the full module names."""
    if isinstance(value, str) and value != "all-linear":
        try:
            re.compile(value)
        except re.error as error:
            raise ValueError(f"{value!r} is not a valid regular expression ({error}); write one that matches full "
                             f"module names (e.g. '.*\\.(q_proj|v_proj)'), or a list of name suffixes") from None
    return value


class ModelSection(StrictModel):
    """`config` alone trains from scratch; `name_or_path` alone fine-tunes a checkpoint; both: the weights come
    from `name_or_path` and the shipped `config` (the same architecture) lets --dry-run and the checks run
    without downloading anything."""
    config: LocalPath | None = None  # architecture: a config.json or its folder
    name_or_path: HubIdOrPath | None = None  # checkpoint to start from: hub id or local folder
    config_overrides: FreeForm = {}  # e.g. {num_hidden_layers: 2} to shrink a model for a smoke test
    # auto: flex_attention on CUDA (packed documents at flash speed), sdpa elsewhere (training/models/attention.py)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = "auto"
    trust_remote_code: bool = False  # run Python code shipped with a hub checkpoint: only for checkpoints you trust

    @model_validator(mode="after")
    def one_source(self) -> "ModelSection":
        if self.config is None and self.name_or_path is None:
            raise ValueError("set model.config (an architecture to train from scratch), model.name_or_path (a "
                             "checkpoint to start from), or both (the checkpoint's architecture, shipped)")
        return self


class TokenizerSection(StrictModel):
    name_or_path: HubIdOrPath | None = None  # default: model.name_or_path


def number_or_auto(value: Any, handler: Callable[[Any], Any]) -> int | str:
    """training.micro_batch_size's one message for every wrong value (pydantic would give one per union member)."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(f"a positive whole number of rows per rank, or auto (the largest micro-batch that fits the "
                         f"memory plan, training/planning/micro_batch.py); got {value!r}") from None


MicroBatchSize = Annotated[PositiveInt | Literal["auto"], WrapValidator(number_or_auto)]


@dataclass(frozen=True)
class ObjectiveTraits:
    """What the plan needs to know of a training objective before anything is built (its training code:
    training/objectives/, docs/objectives.md)."""
    model_loss: bool  # its loss is the model's next-token loss over target tokens, which the fused loss may replace
    rows_per_example: int  # the rows a training example takes at most, for the memory plan (a DPO pair: 2)
    unit: str  # what micro_batch_size and global_batch_size count
    examples: Examples  # what the data holds (data_pipeline/config.py)
    generates: bool = False  # it samples from the trained model (grpo:): the plan counts the generation and reference
    token_statistics: bool = False  # it reads statistics of the logits a chunk of tokens at a time (dpo: TRL's token
    # metrics and WPO's weights), whose chunk the plan counts


OBJECTIVES = {"lm": ObjectiveTraits(model_loss=True, rows_per_example=1, unit="rows", examples="documents"),
              "dpo": ObjectiveTraits(model_loss=False, rows_per_example=2, unit="pairs", examples="pairs",
                                     token_statistics=True),
              "grpo": ObjectiveTraits(model_loss=False, rows_per_example=1, unit="completions", examples="prompts",
                                      generates=True)}


def known_objective(name: str) -> str:
    if name not in OBJECTIVES:
        raise ValueError(f"{name!r} is not an objective here; use one of {', '.join(map(repr, OBJECTIVES))}")
    return name


class TrainingSection(StrictModel):
    objective: Annotated[str, AfterValidator(known_objective)] = "lm"  # OBJECTIVES: lm, next-token loss (pretraining,
    # SFT); dpo, preference pairs (dpo:)
    micro_batch_size: MicroBatchSize  # rows per rank per forward pass (dpo: pairs, packed into as few rows as fit);
    # auto: the largest that fits the memory plan, a number once the plan is made
    global_batch_size: PositiveInt  # rows per optimizer step = micro x accumulation x data-parallel ranks (dpo: pairs)
    max_steps: PositiveInt | None = None
    epochs: PositiveInt | None = None
    lr: PositiveFloat
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine and wsd end at lr x min_lr_ratio; linear ends at 0
    decay_ratio: float = Field(0.2, gt=0, le=1)  # wsd: share of the steps spent in the final decay
    weight_decay: NonNegativeFloat = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    grad_clip: NonNegativeFloat = 1.0  # 0 turns clipping off
    seed: int = 1234
    eval_every_steps: PositiveInt | None = None  # with an eval split (data.eval): also at the end of the run
    eval_max_rows: PositiveInt | None = None  # None: every evaluation row (dpo: pair; grpo: prompt)

    @property
    def traits(self) -> ObjectiveTraits:
        return OBJECTIVES[self.objective]

    def total_steps(self, steps_per_epoch: int) -> int:
        """The run's optimizer steps: max_steps, or epochs of `steps_per_epoch` (the training batches')."""
        return self.max_steps or self.epochs * steps_per_epoch

    @model_validator(mode="after")
    def steps_or_epochs(self) -> "TrainingSection":
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of training.max_steps and training.epochs")
        return self


class OptimizerSection(StrictModel):
    """Which update rule (training/loop/optimizer.py). The learning rate, betas, eps, weight decay and clipping stay in
    `training`: AdamW and AdamW8bit use them all, Lion all but eps, Adafactor the rate and weight decay, Muon its
    own rate and momentum for the decoder layers' matrices and AdamW (training.*) for the rest."""
    name: Literal["adamw", "adamw8bit", "adafactor", "lion", "muon"] = "adamw"
    muon_lr: PositiveFloat = 0.02  # Muon's matrices (the schedule scales it as it scales training.lr)
    muon_momentum: float = Field(0.95, gt=0, lt=1)  # Muon's momentum (Nesterov)

    @model_validator(mode="after")
    def muon_settings_only_for_muon(self) -> "OptimizerSection":
        stray = sorted(self.model_fields_set & {"muon_lr", "muon_momentum"})
        if stray and self.name != "muon":
            raise ValueError(f"optimizer.{stray[0]} applies to optimizer.name=muon, not {self.name}")
        return self


class DeepSpeedSection(StrictModel):
    config: str = "zero1"  # a name under ds_configs/ (zero0..zero3, zero2_offload, ...), a JSON file, or auto
    # (auto: chosen from the memory plan, training/planning/auto_config.py)
    overrides: FreeForm = {}  # merged into that JSON, e.g. {zero_optimization: {overlap_comm: false}}


class ParallelismSection(StrictModel):
    pipeline_stages: PositiveInt = 1  # > 1: DeepSpeed pipeline parallelism; world size = data-parallel x stages
    partition_method: Literal["parameters", "uniform"] = "parameters"  # balance stages by parameters or by layers
    sequence_parallel: PositiveInt = 1  # > 1: Ulysses; each row split over this many ranks (training/parallel/sequence_parallel.py)
    tensor_parallel: PositiveInt = 1  # > 1: AutoTP; each matrix split over this many ranks (training/parallel/tensor_parallel.py)
    expert_parallel: PositiveInt = 1  # > 1: AutoEP; each MoE layer's experts split over this many ranks (training/parallel/expert_parallel.py)


class LongContextSection(StrictModel):
    """ALST's memory savers for long rows (training/models/long_context.py); useful with or without sequence parallelism."""
    tiled_mlp: bool = False  # the MLPs on tiles of hidden_size tokens: their intermediate activations never whole
    logits_tile_tokens: PositiveInt | None = None  # head and loss on tiles of this many tokens: no whole logits
    offload_checkpoints: bool = False  # activation checkpointing's saved layer inputs held in host memory


class Fp8Section(StrictModel):
    """precision: fp8 only (training/models/fp8.py)."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"  # torchao's scaling recipes
    lm_head: bool = False  # also the LM head in FP8 (kept in BF16 by default: its logits feed the loss directly)
    exclude: list[str] = []  # module names (fnmatch patterns) kept in BF16, e.g. ["model.layers.0.*"]


class LoraSection(StrictModel):
    """Low-rank adapters (peft) trained on a frozen base model (training/models/lora.py)."""
    enabled: bool = False
    rank: PositiveInt = 16
    alpha: PositiveFloat = 32  # the adapters' output is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapters' input
    # module name suffixes, a regular expression over the full names, or all-linear (every linear layer but the LM
    # head; MoE experts' fused weights are not linear layers)
    target_modules: Annotated[list[str] | str, AfterValidator(regular_expression)] = "all-linear"
    modules_to_save: list[str] = []  # modules trained in full besides the adapters, e.g. [lm_head]
    quantize: Literal["none", "nf4"] = "none"  # nf4: QLoRA, the frozen base model in 4 bits (bitsandbytes, CUDA)

    @model_validator(mode="after")
    def settings_only_when_enabled(self) -> "LoraSection":
        stray = sorted(self.model_fields_set - {"enabled"})
        if stray and not self.enabled:
            raise ValueError(f"lora.{stray[0]} is set but lora.enabled is false: set lora.enabled=true to train "
                             f"adapters, or remove the lora settings")
        return self


class MoeSection(StrictModel):
    """Mixture-of-experts models (training/models/moe.py)."""
    aux_loss_coef: NonNegativeFloat | None = None  # the router's load-balancing loss in the training loss, times
    # this; None: the checkpoint config's router_aux_loss_coef; 0: off


DpoLoss = Literal["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop", "sigmoid_norm", "aot", "aot_unpaired", "sft"]
SORTED_LOSSES = {"aot", "aot_unpaired"}  # over a micro-batch's pairs, sorted


F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}


TRL_SHARED_NAMES = {  # DPOConfig's and GRPOConfig's alike, for the unknown-key error: where they live here
    "model_init_kwargs": "the model section builds the model (model.name_or_path, model.attn_implementation, "
                         "model.trust_remote_code) in the run's precision",
    "trust_remote_code": "write model.trust_remote_code",
    "router_aux_loss_coef": "write moe.aux_loss_coef (0 with dpo and grpo: their losses have no place for the "
                            "router's)",
    "pad_to_multiple_of": "rows are data.seq_len long when packed (data.packing), else padded to the micro-batch's "
                          "longest",
}


class DpoSection(StrictModel):
    """training.objective=dpo (training/objectives/dpo.py): the preference loss against a frozen reference, the
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
    # tokens of log p(token) - log sum p(v)^2, exponentiated, without a gradient (training/objectives/dpo.py)
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


class RewardSpec(StrictModel):
    """One reward function of grpo.rewards (training/objectives/rewards.py): a function, or a reward model."""
    function: str | None = None  # a built-in (exact_answer, format_regex, length_penalty) or module:function, TRL's
    # signature; a module beside the recipe's YAML is found by its name
    model: HubIdOrPath | None = None  # or a reward model (TRL's, named in reward_funcs): a sequence classifier
    # checkpoint with one label, whose logit scores each prompt and completion (a local folder, or a hub id)
    weight: float = 1.0  # the rewards' weighted sum is the reward the advantages are taken of
    params: dict[str, Any] = {}  # keyword arguments: a built-in's settings, or passed to the callable

    @model_validator(mode="after")
    def a_function_or_a_model(self) -> "RewardSpec":
        if (self.function is None) == (self.model is None):
            raise ValueError("a reward names a function or a model, one of them: {function: exact_answer} or "
                             "{model: path/to/reward_model}")
        if self.model is not None and self.params:
            raise ValueError("a reward model takes no params (they are a function's keyword arguments)")
        return self


class GenerationKwargs(StrictModel):
    """grpo.generation_kwargs: TRL's pass-through to transformers' GenerationConfig, for the settings that keep one
    seeded sample per completion (training/objectives/grpo.py, sample). Each default is transformers' "off"."""
    stop_strings: list[str] = []  # a completion also ends where it completes one of them (kept; not truncated)
    min_new_tokens: NonNegativeInt = 0  # EOS barred before this many completion tokens
    no_repeat_ngram_size: NonNegativeInt = 0  # no n-gram of this size twice in a prompt and its completion
    bad_words_ids: list[list[NonNegativeInt]] = []  # token sequences never completed
    suppress_tokens: list[NonNegativeInt] = []  # tokens never sampled
    begin_suppress_tokens: list[NonNegativeInt] = []  # tokens never sampled first
    sequence_bias: list[tuple[list[NonNegativeInt], float]] = []  # [[token ids], bias]: the bias added to the last
    # token's logit where the others precede it
    top_h: float | None = Field(None, gt=0, le=1)  # the sampling warpers beyond grpo's own, in transformers' order
    # (after temperature, top_k, top_p and min_p, but top_h before top_k): top-H's entropy bound,
    typical_p: float = Field(1.0, gt=0, le=1)  # locally typical sampling's mass,
    epsilon_cutoff: float = Field(0.0, ge=0, lt=1)  # tokens below this probability cut,
    eta_cutoff: float = Field(0.0, ge=0, lt=1)  # eta sampling's cut
    trl_names: ClassVar[dict[str, str]] = {  # GenerationConfig's, which TRL's generation_kwargs also takes
        **{name: f"write grpo.{name}" for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
        **dict.fromkeys(("max_new_tokens", "max_length"), "write grpo.max_completion_length"),
        **dict.fromkeys(("do_sample", "num_beams", "num_return_sequences"),
                        "each completion is one seeded sample; grpo.num_generations sets how many per prompt"),
    }

    def passed(self) -> dict[str, Any]:
        """The settings that differ from transformers' defaults, as GenerationConfig takes them (stop_strings and the
        warpers are applied by sample itself)."""
        return self.model_dump(exclude_defaults=True, exclude={"stop_strings", "top_h", "typical_p",
                                                                "epsilon_cutoff", "eta_cutoff"})

    def token_ids(self) -> list[int]:
        """Every token id written here, for the check against the vocabulary."""
        return [*(i for ids in self.bad_words_ids for i in ids), *self.suppress_tokens, *self.begin_suppress_tokens,
                *(i for ids, _ in self.sequence_bias for i in ids)]


class GrpoSection(StrictModel):
    """training.objective=grpo (training/objectives/grpo.py): online RL with verifiable rewards. TRL's GRPOConfig names
    and defaults; training.global_batch_size and micro_batch_size count completions."""
    num_generations: int = Field(8, ge=2)  # completions sampled per prompt: a group, whose rewards make the advantages
    num_generations_eval: PositiveInt | None = None  # completions per evaluation prompt (None: num_generations); an
    # evaluation batch holds as many completions as a rank generates in training
    max_completion_length: PositiveInt = 512
    temperature: PositiveFloat = 1.0
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: NonNegativeInt = 0  # sample among the k likeliest tokens only; 0: all
    min_p: float | None = Field(None, ge=0, le=1)  # only tokens at least this x the likeliest's probability (e.g. 0.1)
    repetition_penalty: PositiveFloat = 1.0  # > 1: the logits of tokens already in the prompt or completion divided
    # by it (multiplied where negative; CTRL's penalty, transformers')
    generation_kwargs: GenerationKwargs = GenerationKwargs()  # stop strings, token bans and biases, other warpers
    beta: NonNegativeFloat = 0.0  # the KL term's weight, against the starting model (LoRA: the base); 0: no reference
    sync_ref_model: bool = False  # TR-DPO: every ref_model_sync_steps steps the reference becomes
    # ref_model_mixup_alpha x the policy + (1 - alpha) x itself (beta > 0, a full fine-tune; saved with each checkpoint)
    ref_model_mixup_alpha: float = Field(0.6, gt=0, le=1)
    ref_model_sync_steps: PositiveInt = 512
    epsilon: PositiveFloat = 0.2  # clipping of the probability ratio, below
    epsilon_high: PositiveFloat | None = None  # and above (None: epsilon; DAPO: 0.28; cispo: the ratio's cap, 5.0)
    delta: float | None = Field(None, gt=1)  # two-sided clipping (INTELLECT-2): the unclipped ratio capped too;
    # TRL recommends it above 1 + epsilon_high
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = "dapo"  # the formulas:
    # training/objectives/grpo_loss.py
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: one ratio per completion (GSPO)
    sapo_temperature_pos: PositiveFloat = 1.0  # sapo's gate temperature for positive advantages
    sapo_temperature_neg: PositiveFloat = 1.05  # and for the others
    vespo_k_pos: NonNegativeFloat = 2.0  # vespo's gamma weighting, for advantages >= 0: power
    vespo_lambda_pos: PositiveFloat = 3.0  # and decay
    vespo_k_neg: NonNegativeFloat = 3.0  # for negative advantages
    vespo_lambda_neg: PositiveFloat = 2.0
    scale_rewards: Literal["group", "batch", "none"] = "group"  # the advantages divided by the group's reward std,
    # the global batch's, or not at all (Dr. GRPO)
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"  # or
    # each reward function normalized over the group before the weighted sum (GDPO; scale_rewards unused)
    use_bias_correction_kl: bool = True  # the KL term times the probability ratio (DeepSeek-V3.2's unbiased KL)
    off_policy_mask_threshold: PositiveFloat | None = None  # completions with a negative advantage and a mean KL
    # from the sampling policy above it take no policy loss (DeepSeek-V3.2; e.g. 0.5)
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)  # only this top share of tokens by entropy take the
    # policy loss (Beyond the 80/20 Rule: 0.2); 1: all
    entropy_coef: float = 0.0  # the weight of an entropy bonus: the policy's mean entropy over the tokens that take
    # the policy loss, subtracted from the loss (keeps it from collapsing; costs one fp32 [tokens, vocab] tensor)
    use_adaptive_entropy: bool = False  # entropy_coef is the starting value and moves after every step (Skywork-OR1's
    # control): up by entropy_coef_delta while the step's entropy is at or below entropy_target, when the bonus
    # applies, down above it
    entropy_coef_min: NonNegativeFloat = 0.0
    entropy_coef_max: NonNegativeFloat = 1.0
    entropy_coef_delta: PositiveFloat = 0.005
    entropy_target: NonNegativeFloat = 0.2
    num_iterations: PositiveInt = 1  # optimizer steps on each generation (with >1, the old log-probabilities kept)
    generation_batch_size: PositiveInt | None = None  # TRL's: the completions one generation makes over all ranks, a
    # multiple of training.global_batch_size, each optimizer step training on the next global batch of them (None:
    # one step's); decoding reads the weights once per pass whatever the batch. TRL's steps_per_generation is this
    # over micro_batch_size x ranks (micro-steps)
    mask_truncated_completions: bool = False  # completions cut at max_completion_length take no loss
    disable_dropout: bool = False  # the model's dropout off (TRL's default for GRPO is to keep it): the ratios and the
    # KL then compare log-probabilities computed alike (training/models/model.py, disable_dropout)
    cast_lm_head_to_fp32: bool = False  # the LM head's matmul and logits in fp32 in a bf16 run, for the policy, the
    # reference and sampling (ScaleRL; its weight stays bf16, cast in each pass: training/models/model.py)
    ds3_gather_for_generation: bool = False  # ZeRO-3: the whole weights gathered once per generation (a full copy on
    # each rank while it generates) in place of each layer's in every decoding pass (TRL's default is true)
    chat_template_kwargs: dict[str, Any] = {}  # passed to the tokenizer's chat template with a prompt of chat messages
    # (e.g. {enable_thinking: false} for Qwen3)
    rewards: list[RewardSpec] = []
    log_completions_every: PositiveInt | None = None  # steps between samples of prompts, completions and rewards
    # in completions.jsonl; None: never
    trl_names: ClassVar[dict[str, str]] = {  # GRPOConfig's and GRPOTrainer's, for the unknown-key error: where they
        # live here
        "steps_per_generation": "write grpo.generation_batch_size, in completions over all ranks (TRL's "
                                "steps_per_generation x per_device_train_batch_size x ranks)",
        "reward_funcs": "write grpo.rewards (a list of {function, weight, params})",
        "reward_weights": "write a weight on each grpo.rewards entry",
        **dict.fromkeys(("log_completions", "num_completions_to_print"),
                        "write grpo.log_completions_every (steps between samples in completions.jsonl)"),
        "shuffle_dataset": "the prompts are always shuffled, seeded by training.seed",
        **dict.fromkeys(("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                         "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                         "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_min",
                         "vllm_importance_sampling_clip_max", "vllm_model_impl", "vllm_enable_sleep_mode",
                         "vllm_max_model_length", "vllm_structured_outputs_regex", "vllm_server_base_url",
                         "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port"),
                        "not built: no vLLM release installs beside this product's pins; generation runs on "
                        "transformers' generate (docs/grpo.md)"),
        **dict.fromkeys(("use_transformers_paged", "use_transformers_continuous_batching",
                         "transformers_continuous_batching_config"),
                        "not built: generation runs on transformers' generate, batched"),
        "cache_implementation": "not built: generate's default KV cache (dynamic), which the memory plan counts",
        **dict.fromkeys(("tools", "max_tool_calling_iterations"), "not built: tool calling"),
        **dict.fromkeys(("log_unique_prompts", "log_completions_hub_repo"),
                        "write grpo.log_completions_every (samples in the run's completions.jsonl)"),
        "log_multimodal": "not built: prompts and completions are text",
        **TRL_SHARED_NAMES,
    }

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss has the entropy bonus (and its gradient): a coefficient, or adaptive control, which keeps
        it on while its coefficient is 0 so that the coefficient can rise again."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    @model_validator(mode="after")
    def entropy_bounds_in_order(self) -> "GrpoSection":
        if self.use_adaptive_entropy and self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"grpo.entropy_coef_min={self.entropy_coef_min} is above grpo.entropy_coef_max="
                             f"{self.entropy_coef_max}: adaptive entropy control keeps the coefficient between them")
        return self

    @model_validator(mode="after")
    def completions_can_be_as_long_as_asked(self) -> "GrpoSection":
        if self.generation_kwargs.min_new_tokens > self.max_completion_length:
            raise ValueError(f"grpo.generation_kwargs.min_new_tokens={self.generation_kwargs.min_new_tokens} is above "
                             f"grpo.max_completion_length={self.max_completion_length}: no completion could end")
        return self


class ExportSection(StrictModel):
    merge: bool = False  # with lora: also write the base weights with the adapters merged into them (hf/)


class CheckpointingSection(StrictModel):
    every_steps: PositiveInt | None = None  # None: only at the end
    keep_last: PositiveInt | None = None  # None: keep every checkpoint


class StabilitySection(StrictModel):
    """Non-finite and spiking steps (training/loop/stability.py). A step whose loss or gradient is not finite is never
    applied; a loss spike is not applied either, and with `rewind` the run also goes back to its last checkpoint."""
    enabled: bool = True
    policy: Literal["skip", "rewind"] = "skip"  # skip: pass over the batch; rewind: to the last checkpoint, past it
    window: PositiveInt = 50  # recent applied steps that a spike is measured against
    min_history: PositiveInt = 20  # applied steps before spikes are looked for (losses fall fast at first)
    spike_sigma: PositiveFloat = 6.0  # a loss spike: above the window's mean by this many standard deviations
    spike_grad_factor: PositiveFloat | None = None  # a gradient spike: norm above this x the window's median (off:
    # tiny_llama's own default run has a norm 19x its median without any loss spike; clipping bounds such a step)
    max_skips: PositiveInt = 10  # this many skipped batches within skip_window steps: save and stop (exit 3)
    skip_window: PositiveInt = 100
    max_rewinds: PositiveInt = 3  # then save and stop (exit 3): the data or the settings need a human
    rewind_lr_factor: float = Field(1.0, gt=0, le=1)  # after a rewind, the learning rate x this ...
    rewind_lr_steps: NonNegativeInt = 0  # ... for this many steps

    @model_validator(mode="after")
    def history_fits_the_window(self) -> "StabilitySection":
        if self.min_history > self.window:
            raise ValueError(f"stability.min_history={self.min_history} is more than stability.window={self.window}: "
                             f"the window would never hold that many steps, and no spike would be looked for")
        return self


class LoggingSection(StrictModel):
    every_steps: PositiveInt = 10
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]  # training/loop/trackers.py
    project: str | None = None  # the W&B project and MLflow experiment; default: the recipe's name
    run_name: str | None = None  # the tracker run's name; default: the output folder's name
    peak_tflops: PositiveFloat | None = None  # the GPU's dense bf16 peak that MFU divides by; default: training/planning/flops.py

    @model_validator(mode="before")
    @classmethod
    def tensorboard_is_a_tracker(cls, data: object) -> object:
        if isinstance(data, dict) and "tensorboard" in data:
            raise ValueError("logging.tensorboard is now one of logging.report_to's trackers: write report_to: "
                             "[tensorboard] (the default), [tensorboard, wandb, mlflow], or [] for none")
        return data


class EvalSection(StrictModel):
    benchmarks: list[str] = []  # lm-eval tasks run on hf/ at the end of training (training/loop/benchmarks.py)
    benchmark_checkpoints: bool = False  # also on each periodic checkpoint, as it is saved
    batch_size: PositiveInt = 8
    limit: PositiveInt | None = None  # at most this many examples per task

    @model_validator(mode="after")
    def checkpoints_need_tasks(self) -> "EvalSection":
        if self.benchmark_checkpoints and not self.benchmarks:
            raise ValueError("benchmark_checkpoints runs eval.benchmarks on each checkpoint: name the tasks, e.g. "
                             "eval.benchmarks=[python_docs_mc]")
        return self


class Recipe(StrictModel):
    model: ModelSection
    tokenizer: TokenizerSection = TokenizerSection()
    data: DataConfig
    training: TrainingSection
    optimizer: OptimizerSection = OptimizerSection()
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    precision: Literal["auto", "bf16", "fp16", "fp32", "fp8"] = "auto"
    fp8: Fp8Section = Fp8Section()
    activation_checkpointing: bool = False
    # torch.compile each decoder layer (training/models/compile.py); auto: on where it is proven faster (CUDA,
    # ZeRO 0-2, data parallel), off on CPU
    compile: Literal["auto"] | bool = "auto"
    # the LM head and cross-entropy in chunks of tokens, gradients taken as it goes: the [tokens, vocab] fp32 logits
    # never exist whole (training/models/fused_loss.py); objective lm only
    fused_loss: bool = True
    parallelism: ParallelismSection = ParallelismSection()
    lora: LoraSection = LoraSection()
    moe: MoeSection = MoeSection()
    dpo: DpoSection = DpoSection()
    grpo: GrpoSection = GrpoSection()
    export: ExportSection = ExportSection()
    long_context: LongContextSection = LongContextSection()
    checkpointing: CheckpointingSection = CheckpointingSection()
    stability: StabilitySection = StabilitySection()
    logging: LoggingSection = LoggingSection()
    eval: EvalSection = EvalSection()

    _name: str = PrivateAttr("")
    _path: Path = PrivateAttr(Path())

    @property
    def name(self) -> str:
        return self._name

    @property
    def path(self) -> Path:
        """The YAML file the recipe came from."""
        return self._path

    @model_validator(mode="after")
    def consistent(self) -> "Recipe":
        if self.tokenizer.name_or_path is None and self.model.name_or_path is None:
            raise ValueError("tokenizer.name_or_path is needed when the model is built from model.config")
        if self.stability.enabled and self.stability.policy == "rewind" and not self.checkpointing.every_steps:
            raise ValueError("stability.policy=rewind goes back to the last checkpoint: set checkpointing.every_steps")
        if self.eval.benchmark_checkpoints and not self.checkpointing.every_steps:
            raise ValueError("eval.benchmark_checkpoints scores the checkpoints saved every checkpointing.every_steps "
                             "steps: set it (the final weights are scored by eval.benchmarks alone)")
        if self.eval.benchmark_checkpoints and self.lora.enabled:
            raise ValueError("eval.benchmark_checkpoints: a LoRA checkpoint holds the adapters alone; score the "
                             "run's merged export (export.merge: true) with eval.benchmarks instead")
        if self.parallelism.pipeline_stages > 1 and (self.long_context.tiled_mlp or self.long_context.logits_tile_tokens):
            raise ValueError("long_context tiling with parallelism.pipeline_stages > 1: the pipeline builds its own "
                             "stages from the model's layers and does not tile them; use one or the other")
        if self.long_context.offload_checkpoints and (not self.activation_checkpointing
                                                      or self.parallelism.pipeline_stages > 1):
            raise ValueError("long_context.offload_checkpoints moves activation checkpointing's saved layer inputs "
                             "to host memory: set activation_checkpointing=true (without pipeline stages, whose "
                             "checkpointing DeepSpeed's pipeline engine does)")
        if self.export.merge and not self.lora.enabled:
            raise ValueError("export.merge merges LoRA adapters into the base weights: it needs lora.enabled=true "
                             "(a full fine-tune's hf/ holds its weights already)")
        if self.lora.enabled and not self.model.name_or_path:
            raise ValueError("lora.enabled trains adapters on a frozen base model: set model.name_or_path to the "
                             "checkpoint to adapt (from model.config alone the frozen weights would be random)")
        if self.dpo.model_fields_set and self.training.objective != "dpo":
            raise ValueError(f"dpo.* is set but training.objective is {self.training.objective}: set "
                             f"training.objective=dpo to train on preference pairs, or remove the dpo section")
        if self.grpo.model_fields_set and self.training.objective != "grpo":
            raise ValueError(f"grpo.* is set but training.objective is {self.training.objective}: set "
                             f"training.objective=grpo to train on generated completions, or remove the grpo section")
        if self.training.objective == "grpo":
            self.check_grpo()
        self.data.examples = self.training.traits.examples  # how the data stage reads and prepares the sources
        held = prepared_examples(Path(self.data.prepared)) if self.data.prepared else self.data.examples
        if held != self.data.examples:
            shown = {"documents": "packed rows", "pairs": "preference pairs", "prompts": "prompts"}
            raise ValueError(f"data.prepared={self.data.prepared} holds {shown[held]}, but training.objective is "
                             f"{self.training.objective}, which trains on {shown[self.data.examples]}; prepare the "
                             f"data with this recipe")
        if self.data.streaming and self.training.max_steps is None:
            raise ValueError("data.streaming needs training.max_steps: the length of a stream is not known ahead")
        return self

    def check_grpo(self) -> None:
        """The grpo section against the batch and the data's length."""
        grpo, training = self.grpo, self.training
        if not grpo.rewards:
            raise ValueError("training.objective=grpo needs grpo.rewards: at least one reward function (a built-in "
                             "such as exact_answer, or module:function)")
        if training.global_batch_size % grpo.num_generations:
            raise ValueError(f"training.global_batch_size={training.global_batch_size} counts completions: it must "
                             f"be a multiple of grpo.num_generations={grpo.num_generations} (each prompt's group)")
        if grpo.max_completion_length >= self.data.seq_len:
            raise ValueError(f"grpo.max_completion_length={grpo.max_completion_length} leaves no room for a prompt "
                             f"in data.seq_len={self.data.seq_len}: raise seq_len or lower max_completion_length")
        self.data.completion_tokens = grpo.max_completion_length
        self.data.chat_template_kwargs = grpo.chat_template_kwargs

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer.name_or_path or self.model.name_or_path


def recipe_inputs(recipe: Recipe) -> list[Path]:
    """The local files and folders a run of the recipe reads (hub ids left out): what no output may hold or go inside."""
    data = recipe.data
    paths = [recipe.path, recipe.model.config, recipe.model.name_or_path, recipe.tokenizer.name_or_path, data.prepared]
    for source in data.sources + data.eval.sources:
        paths += matching_files(source.path) if source.path else []
    paths += [spec.local_model for spec in data.filters]
    return [Path(path) for path in paths if path and Path(path).exists()]


def available_recipes() -> list[str]:
    return sorted(p.parent.name for p in RECIPES_DIR.glob("*/recipe.yaml"))


def recipe_file(name_or_path: str) -> Path:
    """A name under recipes/, a recipe folder, or a YAML file."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "recipe.yaml").is_file():
        return path / "recipe.yaml"
    if path.is_file():
        return path
    if (RECIPES_DIR / name_or_path / "recipe.yaml").is_file():
        return RECIPES_DIR / name_or_path / "recipe.yaml"
    if path.is_dir():
        raise ConfigError(f"--recipe {name_or_path}: a folder without recipe.yaml; name a recipe folder or a recipe "
                          f"YAML file. Available recipes: {', '.join(available_recipes())}")
    raise ConfigError(f"unknown recipe '{name_or_path}': not a folder under {RECIPES_DIR} nor a recipe file. "
                      f"Available recipes: {', '.join(available_recipes())}")


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, value = text.partition("=")
    if not sep or not key or "" in key.split("."):
        raise ConfigError(f"override '{text}' is not of the form key.path=value (e.g. training.max_steps=20)")
    try:
        return key.split("."), yaml.safe_load(value)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"override '{text}': the value is not valid YAML ({problem}); write it as YAML, e.g. "
                          f"training.betas=[0.9,0.95], and quote the whole override in the shell") from None


def apply_override(tree: dict, path: list[str], value: Any, text: str) -> None:
    """Set `value` at `path`, creating missing mappings; list items are addressed by their index."""
    node = tree
    for depth, part in enumerate(path[:-1]):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError(f"override '{text}': {'.'.join(path[:depth + 1])} is a {type(node).__name__}, "
                              f"not a mapping")
    last = path[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"override '{text}': {'.'.join(path[:-1])} is a {type(node).__name__}, not a mapping")


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The schema section that the (parent) location of a pydantic error points into."""
    model = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _first_model(field.annotation) if field else None
        if model is None:
            return None
    return model


def _first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, (_first_model(arg) for arg in typing.get_args(annotation))), None)


def describe_error(error: dict) -> str:
    loc = tuple(part for part in error["loc"] if not isinstance(part, str) or not part.startswith("function-"))
    where = ".".join(str(part) for part in loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        section = _model_at(loc[:-1])
        if here := getattr(section, "trl_names", {}).get(loc[-1]):
            return f"{where}: TRL's name, not this schema's: {here}"
        known = list(section.model_fields) if section else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{where}: unknown key; {hint}valid keys here: {', '.join(known)}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("missing", "value_error"):
        message += f" (got {error['input']!r})"
    return f"{where}: {message}"


def validate(tree: dict, base_dir: Path, source: str) -> Recipe:
    try:
        return Recipe.model_validate(tree, context={"base_dir": base_dir})
    except ValidationError as error:
        problems = "\n".join(f"  {describe_error(e)}" for e in error.errors())
        raise ConfigError(f"{source} has {error.error_count()} problem(s):\n{problems}") from None


def load_recipe(name_or_path: str, overrides: list[str] = ()) -> Recipe:
    """Validate the recipe file, then the file with the command-line overrides applied.

    Paths written in the file count from the file's folder; paths given as overrides from the
    current folder."""
    path = recipe_file(name_or_path).resolve()
    try:
        tree = yaml.safe_load(read_text(path)) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections (model, data, training, ...)")
    recipe = validate(tree, path.parent, str(path))
    if overrides:
        tree = recipe.model_dump(exclude_unset=True)
        for text in overrides:
            keys, value = parse_override(text)
            apply_override(tree, keys, value, text)
        recipe = validate(tree, Path.cwd(), f"{path} with the overrides {' '.join(overrides)}")
    recipe._name = path.parent.name if path.name == "recipe.yaml" else path.stem
    recipe._path = path
    return recipe
