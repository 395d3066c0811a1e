"""The DeepSpeed bugs behind two of train.py's refusals, run as the refused layouts would run them (launched with 2
ranks, so that a rank other than 0 holds a sequence slice): prints one JSON line per rank of what each bug does
now. tests/training/compat/test_deepspeed.py asserts that the bugs still show; when one no longer does, its
refusal can be lifted (docs/compat.md).

    deepspeed --num_gpus 2 tests/helpers/upstream_bugs.py

- tensor with sequence parallelism (training/parallel/support.py): AutoTP replaces the engine's mpu, the
  sequence-parallel groups given to deepspeed.initialize, with its own tensor-parallel groups;
- bf16 at ZeRO-1 with sequence parallelism (training/parallel/sequence_parallel.py): DeepSpeed's BF16_Optimizer
  takes Ulysses' mpu for a tensor-parallel one (its model-parallel rank is the sequence rank), so on sequence rank 1
  it finds no gradients of its own for the norm and fails.
"""
import json
import sys
from pathlib import Path

import deepspeed
import deepspeed.runtime.sequence_parallel.parallel_state_sp as ulysses_mpu
import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import end_process  # noqa: E402
from training.parallel import distributed  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=1, hidden_size=32,
                                        intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    return AutoModelForCausalLM.from_config(config)


def autotp_keeps_the_sequence_groups() -> bool:
    model = tiny_llama()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": 2}, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      mpu=ulysses_mpu)
    return engine.mpu is ulysses_mpu


def bf16_zero1_step_error() -> str | None:
    """The error of a bf16 ZeRO-1 step under Ulysses' mpu, or None when the step is taken."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      mpu=ulysses_mpu)
    engine.backward(engine(torch.ones(1, 8, dtype=torch.bfloat16)).float().square().sum())
    try:
        engine.step()
    except RuntimeError as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


def main(argv: list[str]) -> int:
    """The report of this rank, as JSON on stdout (the warm ranks of tests/warm_ranks.py call it too)."""
    distributed.init_distributed()
    ulysses_mpu.initialize_sequence_parallel(sequence_parallel_size=2)
    report = {"rank": distributed.rank(), "autotp_keeps_the_sequence_groups": autotp_keeps_the_sequence_groups()}
    report["bf16_zero1_step_error"] = bf16_zero1_step_error()  # last: the failed rank leaves its peer's group broken
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
