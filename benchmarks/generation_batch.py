"""GRPO's generation time against its batch: how many more completions one generation makes for little more time.

    python benchmarks/generation_batch.py                       # a GPU: the 1.24B Llama in bf16, batches 64, 256, 512
    python benchmarks/generation_batch.py --model-config recipes/tiny_llama/config.json --batches 8,32 \\
        --prompt-len 8 --completion-len 16                      # a CPU (fp32): the plumbing

Decoding reads every weight in every pass whatever the batch, so while a pass is bound by memory bandwidth or by
transformers' per-pass overhead, twice the completions take far less than twice the time: the case for generating
several optimizer steps' completions at once (TRL's steps_per_generation). The model is built from its config with
random weights, so no completion ends early (EOS is no likelier than any other token); the prompts are random tokens
of one length. Each sampler is timed at each batch after an untimed call at that batch (the caching allocator and
the kernels warmed for its shapes):
  - ours: training/objectives/grpo/sampling.py's `sample` with sdpa, as GRPO decodes (`decoding`): transformers'
    generate with SeededSampling, each completion drawing from its own random stream, so it does not depend on its
    batch. The seconds, completion tokens/s and milliseconds per decoding pass;
  - on a GPU, ours with FlexAttention kept for decoding (what `decoding` switches away from);
  - transformers' own sampling (one random stream for the whole batch), sdpa, at the same settings: its seconds, and
    ours over it (what the per-completion streams cost);
  - on a GPU of flops.py's table, the floor: what the passes read (training/objectives/grpo/memory.py,
    decoding_reads) at its bandwidth.
Writes table.md to --output when given.
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.tables import write_table  # noqa: E402
from training.objectives.grpo.memory import decoding_reads  # noqa: E402
from training.objectives.grpo.sampling import sample  # noqa: E402
from training.objectives.grpo.spec import GrpoSection  # noqa: E402
from training.planning.flops import gpu_spec  # noqa: E402
from training.planning.shape import model_shape  # noqa: E402


def seconds(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def ours(model: torch.nn.Module, prompts: torch.Tensor, section: GrpoSection, eos_id: int,
         attention: str = "sdpa") -> Callable[[], object]:
    """GRPO's sampling with the model's attention set to `attention` for the call (the model is not compiled, so
    the decoding context's eager stance changes nothing here)."""
    rows = list(prompts)

    def call() -> None:
        model.set_attn_implementation(attention)
        try:
            sample(model, rows, list(range(len(rows))), section, eos_id, pad_id=0, synced=False)
        finally:
            model.set_attn_implementation("sdpa")
    return call


def transformers_sampling(model: torch.nn.Module, prompts: torch.Tensor, section: GrpoSection,
                          eos_id: int) -> Callable[[], object]:
    config = GenerationConfig(do_sample=True, temperature=section.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=section.max_completion_length, eos_token_id=eos_id, pad_token_id=0,
                              use_cache=True)
    mask = torch.ones_like(prompts)
    return lambda: model.generate(input_ids=prompts, attention_mask=mask, generation_config=config)


def warm_seconds(call: Callable[[], object], device: torch.device) -> float:
    call()
    return seconds(call, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", type=Path, default=REPO / "benchmarks/llama_1b/config.json")
    parser.add_argument("--batches", default="64,256,512", help="completions per generation, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--output", type=Path, help="a folder for table.md")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(args.model_config)
    torch.manual_seed(0)
    with device:  # initialized where it runs: a 1B model's random init on the host takes longer than the benchmark
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    shape, section = model_shape(config), GrpoSection(max_completion_length=args.completion_len)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    spec, batches = gpu_spec(name), [int(batch) for batch in args.batches.split(",")]
    eos_id = config.eos_token_id if isinstance(config.eos_token_id, int) else config.vocab_size - 1
    lines = [f"{args.model_config.name}: {shape.parameters:,} parameters, {dtype}, {name}; prompts of "
             f"{args.prompt_len} tokens, {args.completion_len} new tokens each (decoding passes)", "",
             "| completions | ours s | tokens/s | ms per pass | ours, flex_attention s | transformers' sampling s "
             "| ours / theirs | floor s | ours / floor |", "|---|---|---|---|---|---|---|---|---|"]
    for batch in batches:
        prompts = torch.randint(1, config.vocab_size, (batch, args.prompt_len), device=device)
        mine = warm_seconds(ours(model, prompts, section, eos_id), device)
        flex = f"{warm_seconds(ours(model, prompts, section, eos_id, 'flex_attention'), device):.2f}" \
            if device.type == "cuda" else "-"
        theirs = warm_seconds(transformers_sampling(model, prompts, section, eos_id), device)
        floor = decoding_reads(shape, dtype.itemsize, batch, args.prompt_len, args.completion_len) / spec.bandwidth \
            if spec else None
        floor_cells = f"{floor:.3f} | {mine / floor:.1f}" if floor else "- | -"
        lines.append(f"| {batch} | {mine:.2f} | {batch * args.completion_len / mine:,.0f} | "
                     f"{1000 * mine / args.completion_len:.1f} | {flex} | {theirs:.2f} | {mine / theirs:.2f} | "
                     f"{floor_cells} |")
        print(lines[-1], flush=True)
    write_table(lines, args.output)


if __name__ == "__main__":
    main()
