"""train.py as a user meets it: bad input, --dry-run, a single-process run and its output files."""
import gc
import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import train
from tests.conftest import REPO, SMALL_MODEL, run_train, save_small_checkpoint, train_in_process
from training.objectives.lm.objective import LanguageModel
from training.parallel.build import describe_kernels
from training.trainer import train_step


@pytest.mark.parametrize("args, message", [
    (["--recipe", "tiny_lama"], "unknown recipe 'tiny_lama'.*Available recipes: .*tiny_llama"),
    (["--recipe", "tiny_llama", "training.micro_batch=4"],
     "training.micro_batch: unknown key; did you mean 'micro_batch_size'"),
    (["--recipe", "tiny_llama", "deepspeed.config=zero4"], "no DeepSpeed config 'zero4'.*Available: zero0"),
    (["--recipe", "tiny_llama", "data.seq_len=4096"],
     "data.seq_len=4096 is longer than the model's max_position_embeddings=1024"),
    (["--recipe", "tiny_llama", "training.global_batch_size=12"], r"global_batch_size=12 is not a multiple of .* = 8"),
    (["--recipe", "tiny_llama", "training.lr=.inf"], "training.lr: Input should be a finite number"),
    (["--recipe", "tiny_llama", "deepspeed.overrides.gradient_clipping=.nan"],
     "deepspeed.overrides: nan is not a finite"),
    (["--recipe", "tiny_llama", "deepspeed.config=auto", "parallelism.tensor_parallel=2"],
     "deepspeed.config=auto with parallelism.tensor_parallel=2: the plan is for 1 GPU.* "
     "choose parallelism.tensor_parallel"),
    (["--recipe", "tiny_llama", "deepspeed.config=zero3",
      "deepspeed.overrides={zero_optimization: {offload_optimizer: {device: nvme}}}"],
     "zero_optimization.offload_optimizer.device=nvme needs nvme_path"),
    (["--recipe", "tiny_llama", "deepspeed.overrides={tensor_parallel: {autotp_size: 2}}"],
     "tensor_parallel: train.py sets it from parallelism.tensor_parallel; remove it from the DeepSpeed config"),
])
def test_bad_input_exits_2_before_anything_is_built(args, message, no_model_building, capsys, tmp_path):
    assert train.main(args + ["--output-dir", str(tmp_path / "out")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("encoded", ["recipe", "deepspeed config"])
def test_a_file_that_is_not_utf8_is_named_with_its_line(encoded, no_model_building, capsys, tmp_path):
    shipped = REPO / "recipes/tiny_llama"
    recipe = (shipped / "recipe.yaml").read_text()
    for name in ("config.json", "tokenizer", "corpus.jsonl"):
        recipe = recipe.replace(f": {name}", f": {shipped / name}")
    if encoded == "recipe":
        (tmp_path / "recipe.yaml").write_bytes(recipe.encode() + b"# caf\xe9\n")
    else:
        (tmp_path / "recipe.yaml").write_text(recipe)
        (tmp_path / "zero.json").write_bytes(b'{"zero_optimization": {"stage": 1},\n "note": "caf\xe9"}')
    args = ["--recipe", str(tmp_path / "recipe.yaml"), "--dry-run"]
    assert train.main(args + ([f"deepspeed.config={tmp_path / 'zero.json'}"] if encoded != "recipe" else [])) == 2
    where = f"recipe.yaml:{recipe.count(chr(10)) + 1}" if encoded == "recipe" else "zero.json:2"
    assert f"error: {tmp_path / where}: not UTF-8 text" in capsys.readouterr().err


def test_batch_arithmetic_uses_the_launchers_world_size(no_model_building, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.main(["--recipe", "tiny_llama", "--output-dir", str(tmp_path)]) == 2
    assert "training.micro_batch_size (8) x data-parallel ranks (3) = 24" in capsys.readouterr().err


@pytest.mark.skipif(train.resolve_precision("auto", {}) != "fp32", reason="checks the CPU refusal")
def test_fp16_on_cpu_exits_2(no_model_building, capsys, tmp_path):
    assert train.main(["--recipe", "tiny_llama", "--output-dir", str(tmp_path), "precision=fp16"]) == 2
    assert "precision=fp16 needs an NVIDIA GPU" in capsys.readouterr().err


def test_an_earlier_run_is_not_overwritten_silently(no_model_building, capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / ".written-by.json").write_text('{"command": "train.py"}')
    assert train.main(["--recipe", "tiny_llama", "--output-dir", str(tmp_path)]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    (tmp_path / "mine" / "hf").mkdir(parents=True)  # a folder train.py did not write, with a name a run writes
    assert train.main(["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "mine"), "--overwrite"]) == 2
    assert "holds hf, which train.py did not write" in capsys.readouterr().err
    assert train.main(["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "new"), "--resume"]) == 2
    assert "holds no checkpoint to continue from" in capsys.readouterr().err


def test_default_output_dirs_never_replace_an_earlier_run(monkeypatch, tmp_path):
    from training.state import output_dir
    monkeypatch.setattr(output_dir, "OUTPUT_ROOT", tmp_path)
    assert output_dir.default_output_dir("tiny_llama", resume=False) == tmp_path / "tiny_llama"
    (tmp_path / "tiny_llama" / "checkpoints").mkdir(parents=True)
    (tmp_path / "tiny_llama" / "checkpoints" / "latest").write_text("global_step5")
    assert output_dir.default_output_dir("tiny_llama", resume=False) == tmp_path / "tiny_llama-2"
    assert output_dir.default_output_dir("tiny_llama", resume=True) == tmp_path / "tiny_llama"
    (tmp_path / "tiny_llama-2").mkdir()
    (tmp_path / "tiny_llama-2" / "metrics.jsonl").write_text("")
    assert output_dir.default_output_dir("tiny_llama", resume=False) == tmp_path / "tiny_llama-3"
    assert output_dir.default_output_dir("tiny_llama", resume=True) == tmp_path / "tiny_llama-2"


def test_dry_run_prints_the_plan_and_writes_nothing(no_model_building, capsys, tmp_path):
    assert train.main(["--recipe", "tiny_llama", "--dry-run", "--output-dir", str(tmp_path / "out")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo the console's line wrapping
    assert "4,999,424 parameters" in out
    assert "8 rows/rank x 2 accumulation x 1 data-parallel ranks = 16 rows x 256 tokens = 4,096 tokens per step" in out
    assert "1 (this run)" in out and "activations:" in out and "yes" in out
    assert "precision fp32" in out  # this CPU
    assert not (tmp_path / "out").exists()


def test_dry_run_plans_for_gpus_this_machine_lacks(no_model_building, capsys):
    assert train.main(["--recipe", "tiny_llama", "--dry-run", "--num-gpus", "8", "--gpu-mem", "80",
                       "training.global_batch_size=64"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "8 rows/rank x 1 accumulation x 8 data-parallel ranks" in out and "precision bf16" in out
    assert "8 GPU(s) x 1 node(s)" in out and "80.00 GiB (--gpu-mem)" in out
    assert re.search(r"3 \+ offload .* DeepSpeed estimator", out)


@pytest.mark.parametrize("args, expected", [
    (["--num-gpus", "8"], "use them with --dry-run"),
    (["--dry-run", "--num-gpus", "8", "training.global_batch_size=64"], "give their memory too, e.g. --gpu-mem 80"),
])
def test_what_if_options_misused(args, expected, capsys):
    assert train.main(["--recipe", "tiny_llama", *args]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.slow
def test_single_process_run_writes_the_documented_outputs(tmp_path, data_cache):
    from training.loop.metrics import held_tensor_bytes
    # the census counts every tensor of the process: in a pytest worker, also what earlier tests left held (seen:
    # 230 MiB of autograd graphs that test_memory.py's pack hooks kept alive, until they detached what they saved),
    # which the run's own states are measured beside; garbage collected first, as the census does
    gc.collect()
    before = held_tensor_bytes(torch.optim.SGD([torch.zeros(1, requires_grad=True)])).get("cpu", 0)
    out = tmp_path / "run"
    result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache,
                               "training.max_steps=6", "training.warmup_steps=1", "logging.every_steps=2",
                               "checkpointing.every_steps=2", "checkpointing.keep_last=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4, 6]
    for record in records:
        assert set(record) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes"}
        assert record["tokens_per_s"] > 0 and record["peak_mem_bytes"] > 0 and record["grad_norm"] > 0
    assert records[-1]["loss"] < records[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert ((summary["recipe"], summary["world_size"], summary["zero_stage"], summary["precision"])
            == ("tiny_llama", 1, 1, "fp32"))
    assert summary["final_loss"] == records[-1]["loss"] and summary["steps"] == 6
    assert summary["device"] == "cpu" and "tflops" not in summary and "tflops" not in records[-1]  # GPU only
    # weights + gradients + AdamW moments of the 2-layer model, fp32, measured at the second step (+ small tensors)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out / "hf").parameters())
    assert 16 * params <= summary["model_state_bytes"]["cpu"] - before < 16 * params + 32 * 2**20
    assert summary["ds_config"] == json.loads((out / "ds_config.json").read_text())
    assert "training:\n" in (out / "resolved_recipe.yaml").read_text()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # DeepSpeed's own layout, the last two tags kept
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step6"
    assert sorted(p.name for p in checkpoints.glob("global_step*")) == ["global_step4", "global_step6"]
    assert (checkpoints / "zero_to_fp32.py").exists()
    last = checkpoints / "global_step6"
    assert summary["checkpoint_bytes"] == sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    assert summary["checkpoint_save_s"] > 0
    # hf/ holds exactly the trained weights and loads with from_pretrained
    trained = torch.load(checkpoints / "global_step6" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    exported = load_file(out / "hf" / "model.safetensors")
    assert exported.keys() == trained.keys()
    for name, tensor in trained.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.float32
    assert torch.isfinite(model(torch.tensor([[1, 100, 200]])).logits).all()


@pytest.mark.slow
def test_checkpoint_saves_are_left_out_of_the_timed_intervals(tmp_path, data_cache):
    """Every step saves, and every save takes 3 s longer (a probe): the logged throughput must not see it."""
    out = tmp_path / "run"
    result = run_train(["--slow-save", "3", "--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache,
                        "training.max_steps=4", "logging.every_steps=1", "checkpointing.every_steps=1"],
                       script="tests/helpers/train_with_probes.py")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_tokens = 16 * 256  # tiny_llama's global batch, packed rows
    assert [step_tokens / r["tokens_per_s"] < 3 for r in records] == [True] * 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoint_save_s"] >= 3 and step_tokens / summary["mean_tokens_per_s"] < 3


@pytest.mark.slow
def test_the_launcher_passes_on_exit_code_2_and_the_message_once(tmp_path):
    """Every rank finds the bad input; the message is printed exactly once, however the ranks race (a rank that
    exits first used to get rank 0 killed before it printed)."""
    for _ in range(2):
        result = run_train(["--recipe", "tiny_lama", "--output-dir", str(tmp_path)], ranks=2)
        output = result.stderr + result.stdout
        assert result.returncode == 2 and output.count("error: unknown recipe 'tiny_lama'") == 1, output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("data", [[], ["data.streaming=true", "data.shuffle_buffer=0", "data.dedup.exact=false"]],
                         ids=["prepared", "streaming"])
def test_resume_continues_the_uninterrupted_loss_curve(tmp_path, data_cache, data):
    """3 steps, then --resume to 6, gives the losses of 6 steps in one go (fp32, constant lr so that the
    shorter first run has the same schedule). Kills and SIGTERM: tests/test_train_finetune.py."""
    common = [SMALL_MODEL, data_cache, "training.schedule=constant", "training.warmup_steps=0", "logging.every_steps=1",
              *data]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for out, steps in ((whole, 6), (parts, 3)):
        result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(out), f"training.max_steps={steps}",
                                   *common])
        assert result.returncode == 0, result.stderr[-3000:]
    result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(parts), "--resume", "training.max_steps=6",
                               *common])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {path: [json.loads(line)["loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]
              for path in (whole, parts)}
    assert len(losses[parts]) == 6  # steps 1-3 kept, 4-6 appended
    assert losses[parts] == pytest.approx(losses[whole], abs=1e-6)


@pytest.mark.slow
def test_a_resume_that_raises_max_steps_takes_the_new_schedule_from_its_first_step(tmp_path, data_cache):
    """A cosine over 3 steps, resumed to 6: steps 4-6 train at the learning rates of a run started with 6 steps.
    Before, the first resumed step trained at the old schedule's rate (the loaded optimizer's)."""
    common = ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, "training.schedule=cosine", "training.warmup_steps=1",
              "logging.every_steps=1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for out, more in ((whole, ["training.max_steps=6"]), (parts, ["training.max_steps=3"]),
                      (parts, ["training.max_steps=6", "--resume"])):
        result = train_in_process([*common, "--output-dir", str(out), *more])
        assert result.returncode == 0, result.stderr[-3000:]
    rates = {path: [record["lr"] for record in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())]
             for path in (whole, parts)}
    assert len(set(rates[whole][3:])) == 3  # the schedule moves at every resumed step
    assert rates[parts][3:] == pytest.approx(rates[whole][3:], rel=1e-12)


def test_loss_is_the_token_mean_of_the_whole_global_batch(one_rank):
    """Two micro-batches with 3 and 60 targets: the step's loss and gradient are those of the mean over
    all 63 tokens, not the mean of the two micro-batch means."""
    import deepspeed
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(0, 64, (2, 2, 31))
    labels = input_ids.clone()
    labels[0, :, :-1] = -100  # the first micro-batch keeps the last target of each row, plus one more
    labels[0, 0, 5] = input_ids[0, 0, 5]
    micro_batches = [{"input_ids": input_ids[i], "labels": labels[i], "position_ids": torch.arange(31).expand(2, 31),
                      "length": torch.full((2,), 31)} for i in range(2)]
    reference = LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    token_losses = [F.cross_entropy(reference(input_ids=b["input_ids"]).logits[:, :-1].reshape(-1, 64),
                                    b["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="none")
                    for b in micro_batches]
    targets = [(b["labels"][:, 1:] != -100).sum() for b in micro_batches]
    assert [int(t) for t in targets] == [3, 60]
    global_mean = sum(t.sum() for t in token_losses) / sum(targets)
    global_mean.backward()
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    mean_of_means = sum(t.sum() / n for t, n in zip(token_losses, targets)) / 2

    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    lm = LanguageModel(plan=None)  # its loss and count need no plan
    loss, grad_norm, tokens, stop = train_step(engine, micro_batches, 1, lm)  # one rank: its share is the whole loss
    assert tokens == 4 * 31 and not stop
    torch.testing.assert_close(loss, global_mean.detach(), rtol=1e-6, atol=1e-6)
    assert abs(mean_of_means.item() - global_mean.item()) > 0.01  # the two definitions really differ here
    assert float(grad_norm) == pytest.approx(expected_norm.item(), rel=1e-5)


def save_tiny_checkpoint(path, **config_overrides) -> None:
    config = LlamaConfig(**{"vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                            "num_attention_heads": 4, "num_key_value_heads": 2, **config_overrides})
    LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.parametrize("problem, message", [
    ("no weights", "holds no weights .*model.safetensors"),
    ("missing folder", "model.name_or_path: no folder .*train or download the checkpoint first"),
    ("small vocabulary",
     "the tokenizer .* has 4096 tokens but the model's vocab_size is 1000; use the model's own tokenizer"),
    ("truncated weights", "model.safetensors cannot be read .*: the checkpoint is damaged or incomplete"),
])
def test_bad_checkpoint_exits_2_before_anything_is_built(problem, message, no_model_building, capsys, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    save_tiny_checkpoint(checkpoint, **({"vocab_size": 1000} if problem == "small vocabulary" else {}))
    if problem == "no weights":
        (checkpoint / "model.safetensors").unlink()
    if problem == "truncated weights":
        weights = checkpoint / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:50_000])
    name = "./not/there" if problem == "missing folder" else str(checkpoint)
    args = ["--recipe", "tiny_llama", "model.config=null", f"model.name_or_path={name}", "--output-dir",
            str(tmp_path / "out")]
    assert train.main(args) == 2
    assert re.search(message, capsys.readouterr().err)


def test_resume_into_a_layout_no_conversion_reaches_is_refused(no_model_building, capsys, tmp_path, monkeypatch):
    """ZeRO-2 on 2 ranks resumes under ZeRO-3 on 1 (tests/test_resume_anywhere.py), but not under ZeRO-0; and
    a `latest` that names an unfinished save is refused before anything is built."""
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "global_step4").mkdir(parents=True)
    run_state_of(checkpoints / "global_step4", world_size=2, zero_stage=2)
    (checkpoints / "latest").write_text("global_step4")
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = ["--recipe", "tiny_llama", "--output-dir", str(tmp_path), "--resume", "precision=fp32"]
    assert train.main(args + ["deepspeed.config=zero0"]) == 2
    error = capsys.readouterr().err
    assert "--resume (world_size 2 -> 1, zero_stage 2 -> 0)" in error
    assert "python -m training export" in error
    (checkpoints / "latest").write_text("global_step9")  # names a save that never finished
    assert train.main(args + ["deepspeed.config=zero2"]) == 2
    error = capsys.readouterr().err
    assert "names 'global_step9', not a complete checkpoint" in error
    assert "echo global_step4 >" in error  # the way back to the last good save


def test_pointing_latest_back_never_costs_a_later_complete_checkpoint(earlier_run, no_model_building, capsys,
                                                                        tree_guard):
    """The way back from a damaged checkpoint points `latest` at an earlier one; the later complete one stays: the
    resume is refused before anything is built, saying how to go on (it used to be deleted by the resume)."""
    (earlier_run / "checkpoints" / "latest").write_text("global_step2")
    with tree_guard():
        assert train.main(["--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume",
                           "training.max_steps=8", "precision=fp32"]) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "holds complete checkpoints after global_step2, which `latest` names: global_step4" in error
    assert "they are never deleted: resume from the newest (echo global_step4 >" in error


def test_a_changed_architecture_is_a_mismatch_not_damage(earlier_run, no_model_building, capsys, tree_guard):
    tag = earlier_run / "checkpoints" / "global_step4"
    LlamaConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json").save_pretrained(tag / "hf")
    with tree_guard():
        assert train.main(["--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume", "precision=fp32",
                           "training.max_steps=8", "model.config_overrides.hidden_size=128"]) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "holds another model than this run builds (checkpoint vs run: hidden_size 256 vs 128)" in error
    assert "The checkpoint is not damaged" in error and "echo global_step" not in error


def test_another_tokenizer_is_a_mismatch_too(earlier_run, no_model_building, capsys):
    from transformers import AutoTokenizer
    tag = earlier_run / "checkpoints" / "global_step4"
    LlamaConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json").save_pretrained(tag / "hf")
    other = AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer")
    other.add_tokens(["<other>"])  # one more token: every id is still in range of the model
    other.save_pretrained(tag / "hf")
    assert train.main(["--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume", "precision=fp32",
                       "training.max_steps=8"]) == 2
    assert "was trained with another tokenizer than this run's" in " ".join(capsys.readouterr().err.split())


def run_state_of(tag, **values) -> None:
    state = {"step": 4, "tokens_seen": 100, "world_size": 1, "zero_stage": 1, "precision": "fp32", **values}
    (tag / "run_state.json").write_text(json.dumps(state))
    for rank in range(state["world_size"]):
        (tag / f"rank_state{rank}.pt").write_bytes(b"data position and RNG")


def test_lora_adapters_resume_only_on_the_base_they_were_trained_on(earlier_run, no_model_building, capsys, tmp_path,
                                                                    tree_guard):
    from training.models.model import weights_digest
    base = tmp_path / "base"
    save_small_checkpoint(base)
    tag = earlier_run / "checkpoints" / "global_step4"
    run_state_of(tag, lora=True, base_model={"name_or_path": str(base), "digest": weights_digest(str(base))})
    args = ["--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume", "precision=fp32",
            "model.config=null", f"model.name_or_path={base}", "lora.enabled=true", "training.max_steps=8",
            "deepspeed.config=zero1"]
    assert train.main([*args, "--dry-run"]) == 0  # the same base: the checks pass
    capsys.readouterr()
    save_small_checkpoint(base, max_shard_size="300KB")  # other files: as if the base were retrained in place
    with tree_guard(base):
        assert train.main(args) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert f"the LoRA adapters in {tag} were trained on the base model at {base}" in error
    assert "point model.name_or_path at the base they were trained on" in error


def test_a_sequence_parallel_checkpoint_resumes_in_another_layout_through_a_universal_one(earlier_run, monkeypatch,
                                                                                          no_model_building):
    """Sequence parallelism does not split the weights: its checkpoints convert and load like data-parallel ones
    (the curves: tests/test_resume_anywhere.py); tensor parallelism's do not."""
    run_state_of(earlier_run / "checkpoints" / "global_step4", world_size=2, zero_stage=2, sequence_parallel=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume", "precision=fp32",
            "training.max_steps=8"]
    assert not train.make_plan(train.parse_args([*args, "deepspeed.config=zero2", "parallelism.sequence_parallel=2"])
                               ).resume_universal
    assert train.make_plan(train.parse_args([*args, "deepspeed.config=zero3"])).resume_universal
    with pytest.raises(train.ConfigError, match="tensor_parallel 1 -> 2, sequence_parallel 2 -> 1.*resume in the "
                                                "layout that wrote it"):
        train.make_plan(train.parse_args([*args, "deepspeed.config=zero2", "parallelism.tensor_parallel=2"]))


@pytest.mark.parametrize("overrides, world_size, message", [
    (["parallelism.pipeline_stages=2", "deepspeed.config=zero2"], 2,
     "DeepSpeed's pipeline engine supports ZeRO 0 and 1 only"),
    (["parallelism.pipeline_stages=8", "deepspeed.config=zero1", "training.micro_batch_size=2"], 8,
     "pipeline_stages=8 is more than the model's 4 decoder layers"),
    (["parallelism.pipeline_stages=2"], 3, "pipeline_stages=2 does not divide the 3 rank"),
])
def test_bad_pipeline_settings_exit_2(overrides, world_size, message, no_model_building, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert train.main(["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "out"), *overrides]) == 2
    assert message in capsys.readouterr().err


def test_pipeline_of_an_unsupported_family_lists_the_supported_ones(no_model_building, capsys, monkeypatch, tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=4096).save_pretrained(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["--recipe", "tiny_llama", f"model.config={tmp_path / 'config.json'}", "parallelism.pipeline_stages=2",
            "data.seq_len=128", "--output-dir", str(tmp_path / "out")]
    assert train.main(args) == 2
    assert ("gpt2 models are not supported; pipeline parallelism supports llama, mistral, qwen2, qwen3"
            in capsys.readouterr().err)


def test_shipped_config_and_local_checkpoint_of_another_shape(tmp_path, capsys):
    save_small_checkpoint(tmp_path / "small")  # 2 layers of width 64; tiny_llama's config.json: 4 of 256
    assert train.main(["--recipe", "tiny_llama", "--dry-run", f"model.name_or_path={tmp_path / 'small'}"]) == 2
    error = capsys.readouterr().err
    assert "is another architecture than model.config" in error and "hidden_size 64 vs 256" in error
    assert "set model.config=null" in error


@pytest.mark.slow
def test_compiled_model_trains_the_same_losses(tmp_path, data_cache):
    """compile: true (DeepSpeed's engine.compile, inductor on a CPU) gives the eager run's losses. What it compiled is
    kept in compile_cache_dir: a resume of the run (a new process) compiles nothing, every graph it needs comes from
    the cache, and the summary says so."""
    cache = tmp_path / "compile_cache"
    common = ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, "logging.every_steps=1", f"compile_cache_dir={cache}"]
    curves = {}
    for compiled in (False, True):
        out = tmp_path / f"compile_{compiled}"
        result = run_train([*common, "--output-dir", str(out), "training.max_steps=4",
                            f"compile={str(compiled).lower()}"])
        assert result.returncode == 0, result.stderr[-3000:]
        curves[compiled] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert curves[True] == pytest.approx(curves[False], rel=1e-5)
    cold = json.loads((out / "summary.json").read_text())["kernels"]
    assert cold["compile_cache_dir"] == str(cache) and cold["compiled_layers"] == 2
    assert cold["compile_cache"]["fx_graph_misses"] > 0 and cold["compile_cache"]["fx_graph_hits"] == 0, cold
    result = run_train([*common, "--output-dir", str(out), "--resume", "training.max_steps=6", "compile=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = json.loads((out / "summary.json").read_text())["kernels"]
    warm = kernels["compile_cache"]
    assert warm["fx_graph_misses"] == warm["aot_autograd_misses"] == 0 and warm["fx_graph_hits"] > 0, warm
    assert describe_kernels(kernels).endswith(f", {warm['fx_graph_hits']} of {warm['fx_graph_hits']} compiled graphs "
                                              "from the cache")
