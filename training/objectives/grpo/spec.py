"""training.objective=grpo before anything is built: its recipe section (TRL's GRPOConfig names), traits, and its
check against the batch and the data's length."""
from typing import Any, ClassVar, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from training.base.schema import HubIdOrPath, StrictModel
from training.objectives.spec import TRL_SHARED_NAMES, HeadTraits, ObjectiveSpec


class RewardSpec(StrictModel):
    """One reward function of grpo.rewards (training/objectives/grpo/rewards.py): a function, or a reward model."""
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
    seeded sample per completion (training/objectives/grpo/sampling.py, sample). Each default is transformers'
    "off"."""
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
    """training.objective=grpo (training/objectives/grpo/objective.py): online RL with verifiable rewards. TRL's
    GRPOConfig names and defaults; training.global_batch_size and micro_batch_size count completions."""
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
    generation_engine: Literal["auto", "generate", "static", "compiled", "vllm"] = "auto"  # what samples the
    # completions (training/objectives/grpo/sampling.py): generate, transformers' generate with its dynamic KV cache;
    # static, the same with transformers' static KV cache, allocated once at its full length (no cache growing by
    # concatenation in each pass); compiled, the static cache with each decoding pass compiled (torch.compile; CUDA
    # graphs on a GPU; the prompts padded to a power-of-two width, a graph per width; under ZeRO-3 with
    # ds3_gather_for_generation); the three sample the same completions; vllm, a vLLM server from its own environment
    # (vllm_engine.py; the weights pushed to it before each generation that follows an optimizer step), its own
    # seeded samples; auto: generate (side by side on a CPU no in-process engine is faster at every size, within
    # 0.85-1.31x of it: benchmarks/README.md; unmeasured on a GPU)
    vllm_server_host: str | None = None  # vllm: the host of a vLLM server already running (its model of the run's
    # architecture; the run pushes its weights into it); None: train.py starts one on this machine from
    # vllm_environment, on vllm_server_port, and stops it at the end
    vllm_server_port: PositiveInt = 8000
    vllm_server_timeout: PositiveFloat = 240.0  # seconds to wait for the server to answer /health (TRL's), and for
    # any one request
    vllm_environment: str = ".venv-vllm"  # the virtual environment the server starts from (tools/vllm_env.sh
    # builds it), relative to the repository's root or absolute
    vllm_kv_cache_gib: PositiveInt = 1  # the KV cache a started server allocates on a CPU, in whole GiB
    # (VLLM_CPU_KVCACHE_SPACE, which vLLM reads as an integer)
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)  # and the share of its GPU it takes on one (TRL's)
    vllm_importance_sampling_correction: bool = True  # vllm: each completion's loss weighed by the trainer's over
    # the engine's probability of it (TRL's truncated or masked importance sampling), the engine being slightly
    # off-policy; its mismatch logged as sampling/* (loss.py)
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"  # TRL's: per token or per
    # completion; ratios outside [clip_min, clip_max] clipped to it (truncate) or zeroed (mask)
    vllm_importance_sampling_clip_max: PositiveFloat | None = 3.0
    vllm_importance_sampling_clip_min: NonNegativeFloat | None = None
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
    # training/objectives/grpo/loss.py
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
        "use_vllm": "write grpo.generation_engine=vllm",
        "vllm_mode": "write grpo.generation_engine=vllm: a server, started by train.py (or vllm_server_host's); "
                     "colocated generation is not built",
        "vllm_server_base_url": "write grpo.vllm_server_host and vllm_server_port",
        "vllm_importance_sampling_cap": "write grpo.vllm_importance_sampling_clip_max (TRL's newer name)",
        **dict.fromkeys(("vllm_tensor_parallel_size", "vllm_model_impl", "vllm_enable_sleep_mode",
                         "vllm_max_model_length", "vllm_structured_outputs_regex", "vllm_group_port"),
                        "not built: the vLLM server runs one process, as started (docs/grpo.md)"),
        **dict.fromkeys(("use_transformers_paged", "use_transformers_continuous_batching",
                         "transformers_continuous_batching_config"),
                        "not built: generation runs on transformers' generate, batched"),
        "cache_implementation": "write grpo.generation_engine=static (transformers' static KV cache), compiled "
                                "(the same, its decoding compiled) or generate (its dynamic one, auto's choice)",
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

    @property
    def engine(self) -> str:
        """The engine generation_engine names, auto decided: generate, which neither the static cache nor compiled
        decoding beats on a CPU (benchmarks/results/generation_engines_cpu; unmeasured on a GPU)."""
        return "generate" if self.generation_engine == "auto" else self.generation_engine

    @model_validator(mode="after")
    def entropy_bounds_in_order(self) -> "GrpoSection":
        if self.use_adaptive_entropy and self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"grpo.entropy_coef_min={self.entropy_coef_min} is above grpo.entropy_coef_max="
                             f"{self.entropy_coef_max}: adaptive entropy control keeps the coefficient between them")
        return self

    @model_validator(mode="after")
    def vespo_corrected_per_token(self) -> "GrpoSection":
        if self.loss_type == "vespo" and self.engine == "vllm" and self.vllm_importance_sampling_correction and \
                not self.vllm_importance_sampling_mode.startswith("token_"):
            raise ValueError(f"grpo.loss_type=vespo weighs whole completions itself: with generation_engine=vllm's "
                             f"correction set grpo.vllm_importance_sampling_mode to token_truncate or token_mask "
                             f"(not {self.vllm_importance_sampling_mode}), as TRL requires")
        return self

    @model_validator(mode="after")
    def completions_can_be_as_long_as_asked(self) -> "GrpoSection":
        if self.generation_kwargs.min_new_tokens > self.max_completion_length:
            raise ValueError(f"grpo.generation_kwargs.min_new_tokens={self.generation_kwargs.min_new_tokens} is above "
                             f"grpo.max_completion_length={self.max_completion_length}: no completion could end")
        return self


def check_recipe(recipe) -> None:
    """The grpo section against the batch and the data's length (`recipe`: the validated Recipe)."""
    grpo, training = recipe.grpo, recipe.training
    if not grpo.rewards:
        raise ValueError("training.objective=grpo needs grpo.rewards: at least one reward function (a built-in "
                         "such as exact_answer, or module:function)")
    if training.global_batch_size % grpo.num_generations:
        raise ValueError(f"training.global_batch_size={training.global_batch_size} counts completions: it must "
                         f"be a multiple of grpo.num_generations={grpo.num_generations} (each prompt's group)")
    if grpo.max_completion_length >= recipe.data.seq_len:
        raise ValueError(f"grpo.max_completion_length={grpo.max_completion_length} leaves no room for a prompt "
                         f"in data.seq_len={recipe.data.seq_len}: raise seq_len or lower max_completion_length")
    recipe.data.completion_tokens = grpo.max_completion_length
    recipe.data.chat_template_kwargs = grpo.chat_template_kwargs


def head_traits(grpo: GrpoSection) -> HeadTraits:
    """What GRPO's loss adds at the head: the entropy bonus's gradient, and grpo.cast_lm_head_to_fp32's fp32 head."""
    return HeadTraits(entropy_gradient=grpo.entropy_bonus, fp32_head=grpo.cast_lm_head_to_fp32)


COMPLETIONS_FILE = "completions.jsonl"  # in the output folder: samples of prompts, completions and rewards
# (training/objectives/grpo/objective.py)

def input_paths(section: GrpoSection) -> list[str | None]:
    return [reward.model for reward in section.rewards]


REFUSED_LAYOUTS = {  # the parallel degrees GRPO does not run with (training/parallel/support.py)
    "pipeline_stages": "generation runs the whole model on each rank",
    "tensor_parallel": "not built",
    "sequence_parallel": "a completion is sampled whole",
    "expert_parallel": "not built",
}

GRPO = ObjectiveSpec(name="grpo", runtime="training.objectives.grpo.objective:Grpo",
                     trains_on="generated completions", model_loss=False, rows_per_example=1, unit="completions",
                     examples="prompts", memory="training.objectives.grpo.memory:grpo_memory",
                     generation_length="grpo.max_completion_length", run_files=(COMPLETIONS_FILE,),
                     settings=GrpoSection, head_traits=head_traits, check_recipe=check_recipe,
                     input_paths=input_paths, refused_layouts=REFUSED_LAYOUTS)


def prompt_width(longest: int, engine: str) -> int:
    """The width the prompts are left-padded to: the longest one's; for compiled decoding the next power of two, since
    each KV cache length is a graph of its own (static shapes) and dynamo stops compiling a function after
    torch._dynamo.config.recompile_limit graphs: a few widths for every prompt length a run meets."""
    return 1 << (longest - 1).bit_length() if engine == "compiled" else longest
