"""Model states per rank, estimated before a run: the weights, gradients and optimizer states of each ZeRO setting,
and DeepSpeed's own buffers beside them.

Model states use DeepSpeed's own estimators for ZeRO-2 and ZeRO-3 (with and without CPU offload) in mixed
precision; ZeRO-0/1, and fp32 runs (the estimators assume 16-bit weights), use the ZeRO paper's arithmetic, fp32 under
ZeRO on DeepSpeed's layout of the weights (fp32_zero_states). DeepSpeed's own buffers (its gradient buckets, sized by
the resolved config, and Muon's staged momentum) are added to each (with_deepspeed_buffers). What the objective holds
beside them is training/planning/objective_memory.py's, the run's totals training/planning/memory.py's.

Expert parallelism of N (training/parallel/expert_parallel.py, ZeRO-1 and 2 only) over R data-parallel ranks, with
P parameters of which P_e are the experts' (all layers):
  model states:  S(P - P_e, R) + S(P_e / N, R / N)
     (S the ZeRO setting's per-rank bytes of so many parameters over so many ranks: the routers, attention and
     embeddings whole on every rank, sharded over all R; a rank's E/N experts of each layer sharded over the R/N
     ranks that hold the same experts)
  activations:   training/planning/activations.py
"""
import json
import math
from dataclasses import dataclass, replace

from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from training.compat.deepspeed.zero import zero_cuts
from training.config.optimizers import OPTIMIZERS
from training.config.precision import Precision
from training.planning.ds_config import ds_config_file, zero_stage
from training.planning.layout import EXPERT_PARALLEL_STAGES
from training.planning.precision import DTYPES, is_mixed
from training.planning.shape import ModelShape

ZERO_SETTINGS = ("0", "1", "2", "3", "2_offload", "3_offload")  # named as the ds_configs/zero*.json files

EXPERT_PARALLEL_SETTINGS = tuple(str(stage) for stage in EXPERT_PARALLEL_STAGES)  # no offload with expert parallelism



@dataclass(frozen=True)
class ModelStates:
    device_bytes: float  # per rank (GPU)
    host_bytes: float  # per node (CPU memory with offload; DeepSpeed also counts its loading buffers)
    source: str  # which estimator
    made_in_backward: float = 0.0  # of device_bytes: the whole gradients autograd makes in the backward pass
    generation_bytes: float = 0.0  # what the objective's generation holds beside them, while no activations are

    def peak_with(self, activation_bytes: float) -> float:
        """Peak bytes per rank with a micro-batch's activations, or with a generation's memory where that is larger
        (it comes between the steps, when neither activations nor whole gradients exist). Where the model states
        count whole gradients (ZeRO-0, and ZeRO-1's 16-bit ones), autograd makes them in the backward pass as it
        frees the saved activations: at the end of the forward pass they do not exist yet, and they outgrow the
        activations only where those are smaller (measured on an H200, bf16 ZeRO-1: the peak within 1% of states -
        16-bit gradients + activations)."""
        return self.device_bytes + max(activation_bytes - self.made_in_backward,
                                       self.generation_bytes - self.made_in_backward, 0.0)



def zero_arithmetic(params: float, stage: int, ranks: int, precision: Precision, state_bytes: float = 8.0) -> float:
    """Per-rank bytes of weights + gradients + optimizer states (the ZeRO paper's arithmetic).

    Mixed precision keeps 16-bit weights and gradients (2 + 2 bytes) and fp32 master weights (4) and optimizer
    states (`state_bytes`: AdamW's momentum and variance, 8); under ZeRO also the fp32 copy of its gradient
    partition that DeepSpeed's optimizer steps from (4; measured on an H200: 20.0 bytes per parameter at bf16
    ZeRO-1 with AdamW). fp32 keeps 4 + 4 and, under ZeRO, that fp32 partition copy too (4; measured on CPU
    ranks), at ZeRO-0 only the optimizer states; at ZeRO-2 and 3 also the master weights (4): DeepSpeed clones
    the weights' partition as its master copy in fp32 too. (At ZeRO-1 as well: there the end of the backward pass,
    with the whole gradients and the master copy but no gradient copy yet, is what its 4 + 4 + 12/N count.)
    ZeRO-1 shards the optimizer states over the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too. (ZeRO-0
    bf16 runs as torch autocast over fp32 weights: 16 bytes with AdamW.) Where the weights' shapes are known, an
    fp32 run is counted on DeepSpeed's layout instead (fp32_zero_states); DeepSpeed's own buffers are
    with_deepspeed_buffers'."""
    mixed = is_mixed(precision)
    weights, grads = (2, 2) if mixed else (4, 4)
    optimizer = state_bytes + (4 if mixed or stage >= 2 else 0) + (4 if stage else 0)
    shard = [(1, 1, 1), (1, 1, ranks), (1, ranks, ranks), (ranks, ranks, ranks)][stage]
    return params * (weights / shard[0] + grads / shard[1] + optimizer / shard[2])



def fp32_zero_states(groups: tuple[tuple[tuple[int, ...], ...], ...], stage: int, ranks: int,
                     state_bytes: float = 8.0) -> float:
    """The busiest rank's bytes of weights + gradients + optimizer states in an fp32 run under DeepSpeed's ZeRO-1, 2
    or 3 optimizer, from how it cuts the trained weights (their shapes per parameter group, zero_cuts), as its step
    flattens a group's gradients:
      weights            all of them at ZeRO-1/2; at ZeRO-3 the rank's piece of each (ceil(size / ranks))
      master weights     the rank's partition of each group, cloned in fp32 (also when the weights are fp32)
      gradients          ZeRO-1/2's contiguous buffer holds the whole of every weight the rank has a part of;
                         ZeRO-3's flat buffer the rank's pieces
      gradient copy      the flat fp32 gradient the optimizer steps from: one group's partition at a time
      optimizer states   state_bytes per parameter, sharded
    4 bytes each. train.py's census measures this as the first of two or more groups steps (docs/planning.md);
    stepping a model's only group, ZeRO-1/2 have freed the buffer by then. At ZeRO-1 the end of the backward pass
    may hold more, the whole gradients before they are reduced (in place of the buffer and the copy): the larger."""
    sizes = [math.prod(shape) for group in groups for shape in group]
    params, states = sum(sizes), state_bytes * sum(sizes) / ranks
    if stage == 3:
        partitions = [sum(math.ceil(math.prod(shape) / ranks) for shape in group) for group in groups]
        return 4 * (3 * sum(partitions) + max(partitions)) + states
    partitions = [2 * math.ceil(sum(map(math.prod, group)) / (2 * ranks)) for group in groups]
    whole = max(sum(sizes[index] for index, _, _ in zero_cuts([list(map(math.prod, group)) for group in groups],
                                                             stage, ranks, rank)) for rank in range(ranks))
    held = 4 * (params + sum(partitions) + whole + max(partitions)) + states
    return max(held, 4 * (2 * params + sum(partitions)) + states) if stage == 1 else held



def gradient_bucket_bytes(ds_config: dict, precision: Precision) -> float:
    """Per-rank bytes of DeepSpeed's gradient buckets (its ZeRO optimizers' "ipg" buffers) under a resolved config.

    With contiguous_gradients (DeepSpeed's default) each bucket is reduce_bucket_size elements: ZeRO-1 and 2 make one
    at every backward pass, two with overlap_comm, in the weights' dtype (at ZeRO-1 in the gradient-accumulation
    dtype where it differs), and free them before the optimizer step; ZeRO-3 makes one for the whole run, in the
    communication dtype. ZeRO-0 has none. Unset keys take DeepSpeed's defaults (reduce_bucket_size 5e8 elements,
    overlap_comm on at ZeRO-3 only)."""
    zero = DeepSpeedZeroConfig(**ds_config.get("zero_optimization", {}))
    stage = int(zero.stage)
    offloaded = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none"
    if stage == 0 or not (zero.contiguous_gradients or offloaded):  # ZeRO-Offload makes them contiguous anyway
        return 0.0
    weight_bytes = DTYPES[precision].itemsize
    if stage == 3:
        communication = ds_config.get("communication_data_type")
        return zero.reduce_bucket_size * (DTYPES[communication].itemsize if communication else weight_bytes)
    accumulation = ds_config.get("data_types", {}).get("grad_accum_dtype")
    element = DTYPES[accumulation].itemsize if stage == 1 and accumulation else weight_bytes
    return zero.reduce_bucket_size * element * (2 if zero.overlap_comm else 1)



def shipped_ds_config(setting: str, hidden_size: int) -> dict:
    """ds_configs/zero<setting>.json with its bucket size resolved as train.py resolves "auto" (hidden_size^2, the
    HF Trainer's formula: training/planning/ds_config.py): the config a row of the plan's table stands for."""
    config = json.loads(ds_config_file(f"zero{setting}").read_text())
    zero = config.get("zero_optimization", {})
    if zero.get("reduce_bucket_size") == "auto":
        zero["reduce_bucket_size"] = hidden_size * hidden_size
    return config



def muon_staging_bytes(optimizer: str, shape: ModelShape, stage: int, ranks: int) -> float:
    """DeepSpeed's ZeRO-1/2 Muon writes each step's momentum into a staged copy of its momentum partition, which it
    keeps and commits after the step (stage_1_and_2._muon_staging_momentum): 4 bytes per decoder-layer matrix weight,
    sharded; 0 for other optimizers, stages and LoRA."""
    if not OPTIMIZERS[optimizer].staged_momentum or stage not in (1, 2) or shape.lora_parameters is not None:
        return 0.0
    return 4 * shape.layer_matrix_parameters / ranks



def with_deepspeed_buffers(states: ModelStates, ds_config: dict, precision: Precision, optimizer: str,
                           shape: ModelShape, ranks: int) -> ModelStates:
    """`states` with what DeepSpeed's ZeRO optimizers hold beside weights, gradients and the optimizer's states,
    on the device: the gradient buckets and Muon's staged momentum."""
    stage = zero_stage(ds_config)
    extra = gradient_bucket_bytes(ds_config, precision) + muon_staging_bytes(optimizer, shape, stage, ranks)
    return replace(states, device_bytes=states.device_bytes + extra)



def model_states(setting: str, shape: ModelShape, gpus_per_node: int, nodes: int, precision: Precision,
                 zero_init: bool, state_bytes: float = 8.0) -> ModelStates:
    """Model-state memory for one ZeRO setting over gpus_per_node x nodes data-parallel ranks, with
    `state_bytes` of optimizer states per parameter (DeepSpeed's estimators assume AdamW's 8: the difference
    is taken from the sharded states, on the GPUs or, offloaded, in the nodes' memory)."""
    stage, offload = int(setting[0]), setting.endswith("_offload")
    ranks = gpus_per_node * nodes
    if stage < 2 or precision == Precision.FP32:
        if offload:
            raise ValueError(f"no estimate for ZeRO-{setting} in {precision}")
        trained = sum(math.prod(weight) for group in shape.trained_shapes for weight in group)
        # the weights' shapes are these parameters'
        if precision == Precision.FP32 and stage and trained == shape.parameters:
            return ModelStates(fp32_zero_states(shape.trained_shapes, stage, ranks, state_bytes), 0.0,
                               "ZeRO arithmetic")
        return ModelStates(zero_arithmetic(shape.parameters, stage, ranks, precision, state_bytes), 0.0,
                           "ZeRO arithmetic", whole_gradient_bytes(shape.parameters, stage, precision))
    if stage == 2:
        host, device = estimate_zero2_model_states_mem_needs(shape.parameters, gpus_per_node, nodes, offload)
    else:
        largest_layer = max(shape.layer_parameters + (shape.embedding_parameters, shape.head_parameters))
        host, device, _ = estimate_zero3_model_states_mem_needs(shape.parameters, largest_layer, gpus_per_node,
                                                                nodes, offload, offload, zero_init)
    fewer = (8.0 - state_bytes) * shape.parameters
    if offload:
        host -= fewer / nodes
    else:
        device -= fewer / ranks
    return ModelStates(float(device), float(host), "DeepSpeed estimator")



def whole_gradient_bytes(params: float, stage: int, precision: Precision) -> float:
    """The whole gradients zero_arithmetic counts: ZeRO-0's (fp32: torch autocast keeps fp32 weights) and, in mixed
    precision, ZeRO-1's 16-bit ones; none where ZeRO-2 and 3 reduce them into partitions as the backward pass goes."""
    if stage == 0:
        return 4.0 * params
    return 2.0 * params if stage == 1 and is_mixed(precision) else 0.0



def expert_parallel_states(setting: str, shape: ModelShape, gpus_per_node: int, nodes: int, size: int,
                           precision: Precision, state_bytes: float = 8.0) -> ModelStates:
    """Model states per rank with each MoE layer's experts split over `size` ranks (the formula in the module
    docstring; S is model_states' ZeRO-1 arithmetic or ZeRO-2 estimator, each linear in the parameters). The node's
    memory is the whole model's: each rank builds it whole before AutoEP keeps its experts. The optimizer's bytes
    per parameter are the whole model's mean (exact for AdamW and Lion)."""
    if setting not in EXPERT_PARALLEL_SETTINGS:
        raise ValueError(f"no estimate for ZeRO-{setting} with expert parallelism")
    ranks = gpus_per_node * nodes
    parts = ((shape.parameters - shape.expert_parameters, ranks), (shape.expert_parameters // size, ranks // size))
    device = sum(model_states(setting, replace(shape, parameters=count), shards, 1, precision, False,
                              state_bytes).device_bytes for count, shards in parts)
    whole = model_states(setting, shape, gpus_per_node, nodes, precision, False, state_bytes)
    return ModelStates(device, whole.host_bytes, f"{whole.source}, experts / {size}")



NF4_BYTES = 4.127 / 8  # QLoRA's 4-bit NormalFloat with double-quantized block constants (Dettmers et al. 2023)



def lora_model_states(setting: str, shape: ModelShape, trainable: int, gpus_per_node: int, nodes: int,
                      precision: Precision, state_bytes: float = 8.0, nf4: bool = False) -> ModelStates:
    """Model states of a LoRA run (training/models/lora.py): the frozen base weights in the run's dtype, with no
    gradients, master copy or optimizer states (ZeRO-3 shards them; ZeRO-0 keeps fp32 weights, also under autocast),
    plus the `trainable` parameters' by the ZeRO arithmetic; offload moves those parameters' fp32 master weights, fp32
    gradient partitions and optimizer states to the nodes' memory. With nf4 (QLoRA) the decoder layers' matrices take
    NF4_BYTES each (the embedding, head and norms stay 16-bit)."""
    stage, offload = int(setting[0]), setting.endswith("_offload")
    ranks = gpus_per_node * nodes
    weight_bytes = 2 if stage and is_mixed(precision) else 4
    frozen = shape.parameters * weight_bytes
    if nf4:
        frozen -= shape.layer_matrix_parameters * (weight_bytes - NF4_BYTES)
    frozen /= ranks if stage == 3 else 1
    trained = zero_arithmetic(trainable, stage, ranks, precision, state_bytes)
    host = trainable * (state_bytes + 4 + (4 if is_mixed(precision) else 0)) / ranks if offload else 0.0
    return ModelStates(frozen + trained - host, host * gpus_per_node, "ZeRO arithmetic (LoRA)")
