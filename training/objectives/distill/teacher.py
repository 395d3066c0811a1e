"""distill's teacher: the checkpoint at distill.teacher_model_name_or_path, frozen beside the student as a full
fine-tune's reference is (training/objectives/reference.py, load_frozen): a copy on each rank at ZeRO 0-2; under
ZeRO-3 partitioned over the ranks and run by a DeepSpeed engine of its own, whose forward every rank runs together
(each rank's step and evaluation run as many micro-batches). Its head's weight is read whole by the loss beside the
student's: under ZeRO-3 gathered once, at the start, into a copy of its own (a frozen weight: the copy never goes
stale), which the plan counts (training/objectives/distill/memory.py). A teacher that numbers the run's tokens
otherwise (memory.py, teacher_ids) is read through the mapping: its inputs in its own numbering, its head's rows in
the run's order (a copy)."""
import copy

import deepspeed
import torch

from training.objectives.distill.loss import Logits, distilling
from training.objectives.distill.memory import teacher_config, teacher_ids
from training.objectives.reference import gathered, load_frozen, partitioned
from training.planning.plan import RunPlan


class TeacherModel:
    def __init__(self, plan: RunPlan, engine: deepspeed.DeepSpeedEngine):
        path = plan.recipe.distill.teacher_model_name_or_path
        config = copy.deepcopy(teacher_config(path, plan.recipe.model.trust_remote_code))
        self.model = load_frozen(plan, engine, path, config)
        zero3 = partitioned(self.model)
        self.module = self.model.module if zero3 else self.model  # what generates its samples (seq_kd)
        distilling(self.module)
        ids = teacher_ids(plan.recipe)
        self.ids = None if ids is None else torch.tensor(ids, device=engine.device)
        head = self.module.get_output_embeddings().weight
        with gathered([head], zero3, modified=False):
            self.head_weight = in_run_order(head.detach(), self.ids, copy=zero3)
        self.logits = Logits.of(self.module.config)

    @torch.no_grad()
    def hidden(self, inputs: dict, taken: torch.Tensor) -> torch.Tensor:
        """Its final hidden states at the flat token positions `taken` of the micro-batch's rows."""
        input_ids = inputs["input_ids"] if self.ids is None else self.ids[inputs["input_ids"]]
        hidden = self.model(input_ids=input_ids, position_ids=inputs["position_ids"], hidden_only=True)
        return hidden.reshape(-1, hidden.shape[-1])[taken]


def in_run_order(head: torch.Tensor, ids: torch.Tensor | None, copy: bool) -> torch.Tensor:
    """The teacher's head's rows for the run's token ids in order: where it numbers them otherwise (`ids`: the
    teacher's id of each of the run's), those rows, a copy; else the head itself, or a copy of it (`copy`)."""
    if ids is not None:
        return head.index_select(0, ids)
    return head.clone() if copy else head
