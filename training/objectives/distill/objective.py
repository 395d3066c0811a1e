"""training.objective=distill, knowledge distillation: the student learns the teacher's next-token distributions at
every target token of the packed rows (a chat's completion tokens, every token of a document), TRL's generalized
Jensen-Shannon divergence between the two (loss.py), optionally with its own next-token loss beside it.

A micro-batch's loss is the divergence summed over its target tokens (and lm_loss_weight x the next-token loss
summed over them), over the global batch's target tokens: the step's loss is the token mean over the global batch,
as TRL's num_items_in_batch makes it. Logged: the divergence and the student's entropy, token means (TRL's
`entropy`), and the next-token loss where it is part of the loss. The evaluation gives the held-out rows' next-token
loss (eval_loss, as an lm run's) and their divergence (eval_divergence)."""
import math

import deepspeed
import torch
from transformers import PretrainedConfig

from data_pipeline.loader import EvalBatches, model_inputs
from data_pipeline.prepare import pad_token_id
from training.base.errors import ConfigError
from training.config.recipe import Recipe
from training.models.model import disable_dropout
from training.objectives.distill.loss import Teacher, distilling, target_mask
from training.objectives.distill.memory import sampling_bytes, teacher_bytes, teacher_ids, teacher_shape
from training.objectives.distill.on_policy import SeededRows, sample_sequences
from training.objectives.distill.spec import samples, sampling_section
from training.objectives.distill.teacher import TeacherModel
from training.objectives.distill.vocabulary import check_vocabulary
from training.objectives.grpo.report import ENGINES
from training.objectives.lm.objective import LanguageModel
from training.parallel import distributed
from training.planning.ds_config import params_offloaded
from training.planning.plan import RunPlan
from training.planning.report import format_bytes


def divergence_name(beta: float) -> str:
    if beta == 0:
        return "forward KL(teacher || student) (beta 0)"
    if beta == 1:
        return "reverse KL(student || teacher) (beta 1)"
    return f"generalized JSD, beta {beta:g} (mixture {1 - beta:g} student + {beta:g} teacher)"


class Distill(LanguageModel):
    """training.objective=distill: packed rows, the teacher beside the student, the divergence as the loss."""
    name = "distill"
    carried = ("eval_", "divergence", "entropy", "lm_loss", "sampled/")
    row_batches = SeededRows  # each micro-batch with its rows' indices and the data position (on_policy.py)

    def __init__(self, plan: RunPlan):
        super().__init__(plan)
        self.section = plan.recipe.distill
        self.teacher: TeacherModel | None = None
        self.sums: list[torch.Tensor] = []
        self.sampled: dict[str, int] = {}  # the rank's rows of the step, and how many each model completed

    @staticmethod
    def check(recipe: Recipe, model_config: PretrainedConfig | None, world_size: int | None = None,
              zero_stage: int | None = None) -> None:
        refused = [reason for condition, reason in (
            (recipe.long_context.logits_tile_tokens is not None,
             "long_context.logits_tile_tokens: the divergence projects the heads itself, a tile at a time"),
            (recipe.lora.enabled and "lm_head" in recipe.lora.modules_to_save,
             "lora.modules_to_save with lm_head: the divergence reads the head's weight as a plain linear layer's"),
            (recipe.fp8.lm_head, "fp8.lm_head: the divergence reads the head's weight in the run's dtype"))
            if condition]
        if refused:
            raise ConfigError(f"training.objective=distill does not support {refused[0]}")
        if zero_stage == 3 and samples(recipe.distill) and recipe.distill.generation_engine == "compiled":
            raise ConfigError("distill.generation_engine=compiled under ZeRO-3: each decoding pass would gather the "
                              "partitioned weights inside a compiled graph (grpo.generation_engine refuses it alike); "
                              "use static or generate")
        if model_config is None:
            return
        if getattr(model_config, "output_router_logits", False):
            raise ConfigError("training.objective=distill with the router's load-balancing loss: the loss has no place "
                              "for it; set moe.aux_loss_coef=0")
        check_vocabulary(recipe, model_config)
        if recipe.distill.seq_kd and teacher_ids(recipe):
            raise ConfigError(f"distill.seq_kd with a teacher that numbers the tokens otherwise than the run's "
                              f"tokenizer ({recipe.distill.teacher_model_name_or_path}): its samples would need "
                              f"mapping back to the run's ids, which is not built; use seq_kd=false")

    @staticmethod
    def describe(plan: RunPlan) -> list[str]:
        """Its batch (rows), the divergence and what the teacher costs."""
        section, recipe = plan.recipe.distill, plan.recipe
        path = section.teacher_model_name_or_path
        shape = teacher_shape(path, recipe.model.trust_remote_code)
        per_rank = format_bytes(teacher_bytes(recipe, plan.precision, plan.zero_stage, plan.dims.dp_size))
        if plan.zero_stage != 3:
            place = f"a frozen copy on each rank ({per_rank})"
        else:
            where = "in CPU memory (offload_param)" if params_offloaded(plan.ds_config) else "on the device"
            place = (f"frozen, partitioned over the {plan.dims.dp_size} ranks by ZeRO-3, {where}, and its head's "
                     f"weight whole on each: {per_rank} per rank")
        mixed = f" + {section.lm_loss_weight:g} x the next-token loss" if section.lm_loss_weight else ""
        sampled = []
        if samples(section):
            others = "by the teacher (seq_kd)" if section.seq_kd else "the data's"
            memory = sampling_bytes(recipe, plan.precision, plan.shape, plan.zero_stage, plan.dims.dp_size)
            sampled = [f"sampled: each conversation's completion with probability {section.lmbda:g} the student's "
                       f"(on-policy), the others {others}, at temperature {section.temperature:g}, up to "
                       f"{section.max_new_tokens} new tokens, a batch per model and rank each step (GRPO's sampling, "
                       f"{ENGINES[sampling_section(section).engine]}): {format_bytes(memory)} per rank between "
                       f"the steps (in the memory table's peak where larger than the activations)"]
        return [*LanguageModel.describe(plan),
                f"distill: {divergence_name(section.beta)} at temperature {section.temperature:g}{mixed}, over the "
                f"target tokens (a chat's completion tokens, every token of a document), both heads projected in "
                f"fp32 tiles of TRL's chunked divergence",
                f"teacher: {path}: {shape.parameters:,} parameters, {place}; one forward pass per micro-batch without "
                f"gradients ({2 * shape.parameters:.3e} FLOPs per token more than the training FLOPs below)",
                *sampled]

    def start(self, engine: deepspeed.DeepSpeedEngine, batches, evaluation, resume: bool) -> None:
        """The student's dropout off (distill.disable_dropout), its forward the distilling one, the teacher loaded."""
        if self.section.disable_dropout:
            disable_dropout(engine.module)
        module = engine.module
        distilling(module.get_base_model() if hasattr(module, "get_base_model") else module)
        self.teacher = TeacherModel(self.plan, engine)

    def step_batches(self, engine: deepspeed.DeepSpeedEngine, micro_batches: list[dict]) -> list[dict]:
        """With distill.lmbda > 0 or seq_kd, the drawn rows' completions sampled by the student or the teacher."""
        if not samples(self.section):
            return micro_batches
        models = {"student": engine.module, "teacher": self.teacher.module}
        tokenizer = self.plan.tokenizer
        batches, self.sampled = sample_sequences(
            micro_batches, self.section, self.plan.recipe.training.seed, models, engine.zero_optimization_stage() == 3,
            self.plan.recipe.model.attn_implementation, tokenizer.eos_token_id, pad_token_id(tokenizer))
        self.sampled["rows"] = sum(len(batch["row"]) for batch in micro_batches)
        return batches

    def start_step(self, micro_batches: list[dict]) -> None:
        self.sums = []

    def forward(self, engine: deepspeed.DeepSpeedEngine, batch: dict, per_micro_batch: float, lm_loss_weight: float):
        """The student's forward on the micro-batch with the teacher's states at its target tokens (loss.py)."""
        inputs = model_inputs(batch, engine.device)
        taken = target_mask(inputs["labels"])
        teacher = Teacher(self.teacher.hidden(inputs, taken), self.teacher.head_weight, self.teacher.logits,
                          self.section.beta, self.section.temperature, lm_loss_weight)
        output = engine(**inputs, teacher=teacher, num_items_in_batch=per_micro_batch)
        self.sums.append(torch.stack([output.divergence.detach(), output.entropy.detach(),
                                      output.next_token.detach().float(), taken.sum().float()]))
        return output

    def loss(self, engine: deepspeed.DeepSpeedEngine, batch: dict, per_micro_batch: float,
             shard: tuple[int, int]) -> torch.Tensor:
        return self.forward(engine, batch, per_micro_batch, self.section.lm_loss_weight).loss

    def token_means(self) -> tuple[float, float, float]:
        """The divergence, entropy and next-token loss of every rank's micro-batches since start_step, token means."""
        divergence, entropy, next_token, tokens = distributed.all_reduce(
            torch.stack(self.sums).sum(0).double()).tolist()
        tokens = max(tokens, 1.0)
        return divergence / tokens, entropy / tokens, next_token / tokens

    def metrics(self) -> dict:
        """The token means, and with sampling the shares of the step's rows (every rank's) that the student and the
        teacher completed (sampled/student, sampled/teacher)."""
        divergence, entropy, next_token = self.token_means()
        shares = {}
        if self.sampled:
            student, teacher, rows = distributed.all_reduce_on_host(
                [self.sampled["student"], self.sampled["teacher"], self.sampled["rows"]])
            shares = {"sampled/student": student / rows, **({"sampled/teacher": teacher / rows}
                                                            if self.section.seq_kd else {})}
        return {"divergence": divergence, "entropy": entropy,
                **({"lm_loss": next_token} if self.section.lm_loss_weight else {}), **shares}

    def evaluate(self, engine: deepspeed.DeepSpeedEngine, evaluation: EvalBatches, shard: tuple[int, int]) -> dict:
        """The held-out rows' next-token loss and divergence, token means over every rank's rows."""
        engine.eval()
        self.sums = []
        with torch.no_grad():
            for batch in evaluation:
                self.forward(engine, batch, 1.0, lm_loss_weight=1.0)
        engine.train()
        divergence, entropy, next_token = self.token_means()
        self.sums = []
        return {"eval_loss": next_token, "eval_perplexity": math.exp(min(next_token, 700.0)),
                "eval_divergence": divergence, "eval_entropy": entropy}

    def console(self, record: dict) -> str:
        return ((f"  divergence {record['divergence']:.4f}" if "divergence" in record else "")
                + (f"  on-policy {record['sampled/student']:.0%}" if "sampled/student" in record else "")
                + (f"  eval divergence {record['eval_divergence']:.4f}" if "eval_divergence" in record else "")
                + super().console(record))

    def table(self, summary: dict) -> list[tuple[str, str]]:
        return [*([("divergence to the teacher (last logged step)", f"{summary['divergence']:.4f}")]
                  if "divergence" in summary else []),
                *([("eval divergence", f"{summary['eval_divergence']:.4f}")] if "eval_divergence" in summary else []),
                *super().table(summary)]
