"""grpo.generation_engine=vllm without a server: the request each completion sends, what the engine refuses before
anything is built, the weights it pushes (a checkpoint's names and values, LoRA merged, the trained model
untouched), and the error a server that does not answer ends the run with. With a server: tests/test_grpo_vllm.py."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import REPO
from training.base.errors import ConfigError, EngineError
from training.config.precision import Precision
from training.objectives.grpo.rollout import completion_values
from training.objectives.grpo.spec import GrpoSection
from training.objectives.grpo.vllm_engine import Engine, check_vllm, engine_dtype, engine_weights, request_body


def small_model(head_dim: int = 32) -> AutoModelForCausalLM:
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=2, hidden_size=64,
                                        intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=head_dim)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_a_request_carries_every_sampling_setting_in_vllms_names():
    section = GrpoSection(generation_engine="vllm", max_completion_length=12, temperature=0.7, top_p=0.9, top_k=0,
                          repetition_penalty=1.1, generation_kwargs={"stop_strings": ["."], "min_new_tokens": 2})
    body = request_body("m", [1, 2, 3], 42, section, eos_id=2)
    assert body == {"model": "m", "prompt": [1, 2, 3], "n": 1, "seed": 42, "max_tokens": 12, "temperature": 0.7,
                    "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.1, "min_tokens": 2,
                    "stop": ["."], "include_stop_str_in_output": True, "stop_token_ids": [2], "ignore_eos": False,
                    "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False}
    assert request_body("m", [1], 1, GrpoSection(top_k=5, min_p=0.1), None)["top_k"] == 5
    assert request_body("m", [1], 1, GrpoSection(min_p=0.1), None)["min_p"] == 0.1
    assert request_body("m", [1], 1, GrpoSection(), None)["ignore_eos"] is True


@pytest.mark.parametrize("name, value", [("typical_p", 0.9), ("no_repeat_ngram_size", 2), ("suppress_tokens", [5]),
                                         ("bad_words_ids", [[5, 6]]), ("sequence_bias", [[[5], 1.0]]),
                                         ("top_h", 0.5), ("epsilon_cutoff", 0.01), ("eta_cutoff", 0.01),
                                         ("begin_suppress_tokens", [5])])
def test_a_generation_kwarg_vllm_does_not_honour_is_refused_by_name(name, value):
    section = GrpoSection(generation_engine="vllm", vllm_server_host="127.0.0.1", generation_kwargs={name: value})
    with pytest.raises(ConfigError, match=f"grpo.generation_kwargs.{name} .*generation_engine=generate"):
        check_vllm(section, None, starting=True)


def test_a_missing_environment_and_an_unsupported_head_size_are_refused_before_the_run(tmp_path):
    section = GrpoSection(generation_engine="vllm", vllm_environment=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="grpo.vllm_environment=.*none.*bash tools/vllm_env.sh"):
        check_vllm(section, small_model().config, starting=True)
    check_vllm(section, small_model().config, starting=False)  # python -m data_pipeline: no server is started
    connected = GrpoSection(generation_engine="vllm", vllm_server_host="127.0.0.1")
    check_vllm(connected, small_model().config, starting=True)  # a running server needs no environment here
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="head size 16 .*32, 64"):
            check_vllm(connected, small_model(head_dim=16).config, starting=True)


def test_the_engine_runs_in_the_runs_compute_dtype():
    assert [engine_dtype(p) for p in (Precision.FP32, Precision.BF16, Precision.FP16)] == \
        ["float32", "bfloat16", "float16"]


def test_the_pushed_weights_are_the_checkpoints_names_and_values(tmp_path):
    model = small_model()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    pushed = engine_weights(model, torch.float32, zero3=False)
    assert set(saved) <= set(pushed)  # and a tied head's weight, which save_pretrained leaves out
    for name, tensor in saved.items():
        assert torch.equal(pushed[name], tensor), name
    assert engine_weights(model, torch.bfloat16, zero3=False)["lm_head.weight"].dtype == torch.bfloat16


def test_lora_is_pushed_merged_and_the_trained_weights_stay_as_they_are():
    model = get_peft_model(small_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    pushed = engine_weights(model, torch.float32, zero3=False)
    assert set(pushed) == set(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(pushed[name], tensor, rtol=0, atol=1e-6, msg=name)
    delta = pushed["model.layers.0.self_attn.q_proj.weight"] - \
        model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert delta.abs().max() > 1e-3  # the adapters' own weights are in
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_the_engines_log_probabilities_take_the_completions_layout():
    values = completion_values([torch.tensor([-1.0, -2.0]), torch.tensor([-3.0])], torch.zeros(2, 3, dtype=torch.bool))
    assert values[0, :2].tolist() == [-1.0, -2.0] and values[1, 0] == -3.0
    assert values[0, 2:].isnan().all() and values[1, 1:].isnan().all()


def test_a_server_that_does_not_answer_ends_the_run_naming_it_and_the_way_on(tmp_path):
    section = GrpoSection(generation_engine="vllm", vllm_server_host="127.0.0.1", vllm_server_port=9,
                          vllm_server_timeout=1.0)
    engine = Engine(section, Precision.FP32, 32, tmp_path / "log")
    with pytest.raises(EngineError, match=r"vLLM server at http://127.0.0.1:9 did not answer /health within "
                                          r"grpo.vllm_server_timeout=1 s.*latest checkpoint is intact.*--resume"):
        engine.sample([[1, 2]], [1], 2)


def test_the_correction_is_on_for_the_vllm_engine_only_and_vespo_takes_token_modes():
    from training.objectives.grpo.settings import loss_settings
    assert loss_settings(GrpoSection(generation_engine="vllm")).vllm_importance_sampling_correction
    assert not loss_settings(GrpoSection()).vllm_importance_sampling_correction  # TRL's default True is for vLLM
    assert not loss_settings(GrpoSection(generation_engine="vllm", vllm_importance_sampling_correction=False)) \
        .vllm_importance_sampling_correction
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode to token_truncate or token_mask"):
        GrpoSection(generation_engine="vllm", loss_type="vespo")
    GrpoSection(loss_type="vespo")  # generate: no correction, no mode to refuse
    GrpoSection(generation_engine="vllm", loss_type="vespo", vllm_importance_sampling_mode="token_mask")


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_the_dry_run_counts_the_servers_memory_and_the_pushes_traffic(zero):
    """qwen2_5_1_5b_grpo on 2 ranks, bf16: nothing generated on the ranks but, under ZeRO-3, a push's largest module
    (the 151,936 x 1,536 embedding); the server's weights P x 2 bytes and its KV cache, 28 layers x 2 x 256 (2 KV
    heads of 128) x 2 bytes per token, 1,024 tokens a completion; a push of P x 2 bytes once a step."""
    import train
    from training.objectives.grpo.memory import largest_module
    from training.objectives.grpo.report import plan_lines
    from training.planning.report import format_bytes
    plan = train.make_plan(train.parse_args(["--recipe", "qwen2_5_1_5b_grpo", "--dry-run", "precision=bf16",
                                             f"deepspeed.config={zero}", "grpo.generation_engine=vllm",
                                             "grpo.vllm_server_host=10.0.0.5", "grpo.vllm_kv_cache_gib=2"]),
                           world_size=2)
    text, shape = "\n".join(plan_lines(plan)), plan.shape
    assert largest_module(shape) == 151936 * 1536
    gathered = f"{format_bytes(largest_module(shape) * 2)}: a push's gathered module" if zero == "zero3" else "none"
    assert f"generation memory per rank: {gathered} (the vLLM server samples, beside the ranks)" in text
    assert "a vLLM server's continuous batching" in text and "KV cache growing" not in text
    per_completion = 28 * 2 * 256 * 2 * 1024
    completions = plan.recipe.grpo.generation_batch_size or plan.recipe.training.global_batch_size
    fits = min(2 * 2 ** 30 // per_completion, completions)
    if torch.cuda.is_available():
        assert "of its GPU's memory (grpo.vllm_gpu_memory_utilization" in text
    else:
        assert (f"vLLM server (at 10.0.0.5:8000, already running): {format_bytes(shape.parameters * 2 + 2 * 2 ** 30)} "
                f"of host memory: the weights ({format_bytes(shape.parameters * 2)}) and a KV cache of 2.00 GiB "
                f"(grpo.vllm_kv_cache_gib), room for {fits} of the generation's {completions} completions") in text
    assert (f"weight push: {format_bytes(shape.parameters * 2)} per push (rank 0 holds that copy on the host, writes "
            f"it to /dev/shm and the server reloads it), 1 push(es) per optimizer step: "
            f"{format_bytes(shape.parameters * 2)} per step") in text
    assert "in 768 decoding passes in the vLLM server that each read the weights" in text
    assert "gathered per step" not in text  # the ranks gather no weights for decoding passes


def test_a_started_server_serves_one_node_only(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rank 0's node only.*grpo.vllm_server_host"):
        Engine(GrpoSection(generation_engine="vllm"), Precision.FP32, 32, tmp_path / "log")
    Engine(GrpoSection(generation_engine="vllm", vllm_server_host="10.0.0.5"), Precision.FP32, 32, tmp_path / "log")


def test_a_started_server_that_exits_is_named_with_its_log(tmp_path):
    import subprocess
    import sys
    section = GrpoSection(generation_engine="vllm", vllm_server_port=9, vllm_server_timeout=5.0)
    engine = Engine(section, Precision.FP32, 32, tmp_path / "vllm_server.log")
    engine.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    engine.process.wait()
    with pytest.raises(EngineError, match=r"at http://127.0.0.1:9 \(started by this run; its output: .*vllm_server"
                                          r".log\) exited with code 3 before it was ready"):
        engine.sample([[1, 2]], [1], 2)
    assert engine.process is None  # closed


def test_a_cpu_kv_cache_is_whole_gib_as_vllm_reads_it():
    """vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer: a started server given 0.5 would exit before it answers."""
    from training.config.recipe import load_recipe
    assert load_recipe("tiny_llama_grpo", ["grpo.vllm_kv_cache_gib=2"]).grpo.vllm_kv_cache_gib == 2
    with pytest.raises(ConfigError, match="grpo.vllm_kv_cache_gib"):
        load_recipe("tiny_llama_grpo", ["grpo.vllm_kv_cache_gib=0.5"])
