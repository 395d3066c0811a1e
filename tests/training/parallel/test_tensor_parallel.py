"""parallelism.tensor_parallel: the checks before anything is built, the DeepSpeed config AutoTP runs with, and
the plan's layout and model states per rank (the runs themselves: tests/test_parallelism.py)."""
import pytest

import train
from training.planning.ds_config import with_tensor_parallel


@pytest.mark.parametrize("overrides, gpus, message", [
    (["parallelism.tensor_parallel=3"], 3, "the model's 8 attention heads do not divide into 3 groups"),
    (["parallelism.tensor_parallel=8", "training.global_batch_size=8"], 8,
     "the model's 4 key/value heads do not divide into 8 groups"),
    (["parallelism.tensor_parallel=4"], 2, "2 rank(s) do not form groups of 4"),
    (["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=2"], 4,
     "DeepSpeed 0.19.8 replaces the sequence-parallel groups"),
    (["parallelism.tensor_parallel=2", "parallelism.pipeline_stages=2"], 4,
     "tensor parallelism with pipeline stages is not built"),
    (["parallelism.tensor_parallel=2", "deepspeed.config=zero0"], 2,
     "ZeRO-0: train.py computes ZeRO-0's gradient norm itself"),
    (["parallelism.tensor_parallel=2", "long_context.tiled_mlp=true"], 2,
     "long_context tiling with tensor parallelism is not built"),
])
def test_bad_tensor_parallel_settings_exit_2(overrides, gpus, message, no_model_building, capsys):
    args = ["--recipe", "tiny_llama", "--dry-run", "--num-gpus", str(gpus), "--gpu-mem", "80", "deepspeed.config=zero2",
            *overrides]
    assert train.main(args) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_autotp_config_leaves_the_batch_size_to_deepspeed():
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    assert with_tensor_parallel(config, 1) is config
    assert with_tensor_parallel(config, 2) == {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                                               "tensor_parallel": {"autotp_size": 2}}


def test_the_plan_shows_the_layout_and_a_ranks_share_of_the_model(no_model_building, capsys):
    common = ["--recipe", "llama3_8b", "--dry-run", "--num-gpus", "8", "--gpu-mem", "80", "deepspeed.config=zero1",
              "training.micro_batch_size=4"]
    assert train.main(common) == 0
    data_parallel = " ".join(capsys.readouterr().out.split())
    assert train.main([*common, "parallelism.tensor_parallel=4"]) == 0
    tensor_parallel = " ".join(capsys.readouterr().out.split())
    assert "layout: 8 rank(s) = 2 data-parallel x 4 tensor-parallel x 1 sequence-parallel x 1 pipeline stage(s)" \
        in tensor_parallel
    assert "4 rows/rank x 16 accumulation x 2 data-parallel ranks = 128 rows" in tensor_parallel

    def zero1_states(out: str) -> float:
        row = out.split("│ 1 (this run) │")[1]
        return float(row.split("GiB")[0].strip())
    # ZeRO-1 over 8 ranks: 4 + 12/8 bytes per parameter; over 2 data-parallel ranks of a quarter of the layers'
    # parameters (the embedding and head whole): less
    assert zero1_states(tensor_parallel) < zero1_states(data_parallel)
