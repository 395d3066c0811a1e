"""How GRPO samples a completion: with a random stream of its own (sampling_seed, SeededSampling), so that a
completion is the same under any layout and after a resume, through transformers' `generate` (sample), with sdpa
(decoding), on the in-process engine grpo.generation_engine names: generate's dynamic KV cache; its static one
(`static`), eagerly; or the static one with each decoding pass compiled (`compiled`: torch.compile, CUDA graphs on a
GPU). All three sample the same completions."""
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedTokenizerBase,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from training.compat.torch import uncompiled
from training.compat.transformers import compiled_decoding
from training.objectives.grpo.spec import GrpoSection, prompt_width


def sampling_seed(seed: int, generation: int, row: int, index: int, evaluation: bool = False) -> int:
    """The random stream of completion `index` of the prompt at `row` of the training split in a generation, or of
    the evaluation split (the same streams at every evaluation: what changes is the model)."""
    return int(np.random.SeedSequence([seed, 4 if evaluation else 3, generation, row, index]).generate_state(1)[0])


class SeededSampling(LogitsProcessor):
    """Sampling as transformers' `generate` samples (in its order: repetition_penalty over each row's tokens, its left
    padding left out; temperature; top_h; top_k; top_p; min_p; typical_p; epsilon and eta cutoffs), with a random
    stream per completion, for `generate`'s greedy search: the Gumbel-max draw, argmax(logits + Gumbel noise), is a
    sample of softmax(logits) (tokens cut off stay at -inf); the noise is -log(-log u) of uniform draws u, which take a
    fifth of the time of torch's exponential draws (-log(E)) on a CPU. A draw's decision rests on the largest scores
    alone, so rounding-sized differences of the logits (another ZeRO stage's weights) almost never change a token,
    where an inverse transform draw of one uniform over the cumulative distribution moves with every entry before
    it. transformers' own sampling draws every row from one stream, so a completion would depend on which others share
    its batch, that is on the layout; here it depends on its seed alone. generation_kwargs' token bans and biases are
    generate's own processors, which run before this one: transformers runs the repetition penalty between them, where
    it commutes with the bans' -inf."""

    def __init__(self, seeds: list[int], section: GrpoSection, padding: torch.Tensor, device: torch.device):
        self.generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
        more = section.generation_kwargs
        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(section.temperature)])
        if section.repetition_penalty != 1.0:
            self.warpers.insert(0, RepetitionPenaltyLogitsProcessor(section.repetition_penalty,
                                                                    prompt_ignore_length=padding))
        if more.top_h is not None:
            self.warpers.append(TopHLogitsWarper(more.top_h))
        if section.top_k > 0:
            self.warpers.append(TopKLogitsWarper(section.top_k))
        if section.top_p < 1:
            self.warpers.append(TopPLogitsWarper(section.top_p))
        if section.min_p is not None:
            self.warpers.append(MinPLogitsWarper(section.min_p))
        if more.typical_p < 1:
            self.warpers.append(TypicalLogitsWarper(more.typical_p))
        if more.epsilon_cutoff > 0:
            self.warpers.append(EpsilonLogitsWarper(more.epsilon_cutoff))
        if more.eta_cutoff > 0:
            self.warpers.append(EtaLogitsWarper(more.eta_cutoff, device=device))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self.warpers(input_ids, scores.float())
        uniform = torch.empty_like(scores)
        for row, generator in enumerate(self.generators):
            uniform[row].uniform_(generator=generator)
        return scores - uniform.log_().neg_().log_()


class StopStrings(StoppingCriteria):
    """grpo.generation_kwargs.stop_strings, as transformers' StopStringCriteria finds them, noting where each row first
    completed one: generate pads a stopped row, so its end is not seen in the tokens afterwards."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str], rows: int):
        self.criteria, self.ends = StopStringCriteria(tokenizer, stop_strings), [None] * rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = self.criteria(input_ids, scores)
        for row in done.nonzero().flatten().tolist():
            self.ends[row] = self.ends[row] or input_ids.shape[1]
        return done


def generation_config(section: GrpoSection, eos_id: int | None, pad_id: int,
                      device_type: str = "cpu") -> GenerationConfig:
    """generate's settings for sample: greedy search over SeededSampling's scores, with generation_kwargs' token bans
    and biases, which generate applies before it; the engine's KV cache (static and compiled: allocated at the batch's
    prompt width plus max_completion_length) and whether its decoding passes are compiled (compiled alone)."""
    engine = {"static": {"cache_implementation": "static", "disable_compile": True},
              "compiled": {"cache_implementation": "static", "disable_compile": False,
                           "compile_config": compiled_decoding(device_type)}}.get(section.engine, {})
    return GenerationConfig(do_sample=False, max_new_tokens=section.max_completion_length, eos_token_id=eos_id,
                            pad_token_id=pad_id, use_cache=True, **engine, **section.generation_kwargs.passed())


def sample(model: torch.nn.Module, prompts: list[torch.Tensor], seeds: list[int], section: GrpoSection,
           eos_id: int, pad_id: int, synced: bool,
           tokenizer: PreTrainedTokenizerBase | None = None) -> tuple[list[torch.Tensor], list[bool]]:
    """One completion per prompt (1-D tensors; the same prompt repeated for a group), sampled in one batch, the
    prompts left-padded: each completion ends at its first EOS (kept), where it completes one of
    generation_kwargs.stop_strings (the tokenizer's), or at max_completion_length (truncated)."""
    device, width = prompts[0].device, prompt_width(max(len(p) for p in prompts), section.engine)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    inputs = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(inputs)
    for row, prompt in enumerate(prompts):
        inputs[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    config = generation_config(section, eos_id, pad_id, device.type)
    stops = section.generation_kwargs.stop_strings
    stop = StopStrings(tokenizer, stops, len(prompts)) if stops else None
    with torch.no_grad():
        out = model.generate(input_ids=inputs, attention_mask=mask, generation_config=config, synced_gpus=synced,
                             logits_processor=LogitsProcessorList([SeededSampling(seeds, section, width - lengths,
                                                                                  device)]),
                             stopping_criteria=StoppingCriteriaList([stop] if stop else []))
    completions, truncated = [], []
    for row, sequence in enumerate(out[:, width:]):
        ends = [int(e) + 1 for e in (sequence == eos_id).nonzero()[:1]]
        ends += [stop.ends[row] - width] if stop and stop.ends[row] else []
        length = min(ends, default=min(len(sequence), section.max_completion_length))
        completions.append(sequence[:length].cpu())
        truncated.append(not ends)
    return completions, truncated


@contextmanager
def decoding(model: torch.nn.Module, attention: str, engine: str) -> Iterator[None]:
    """Generation runs with sdpa where training runs FlexAttention: FlexAttention's path builds a block mask in every
    decoding pass; sdpa takes the padding's mask as it is. The eager engines run eagerly: compiled decoder layers
    (training/models/compile.py) would be traced again for each layer's KV cache, whose state dynamo guards on, until
    dynamo's recompile limit (the first generation of a 1.24B Llama on an H200 took 34.5 s instead of 4: docs/grpo.md).
    Compiled decoding compiles the whole model's call, with those layers' own compiled calls set aside."""
    if attention == "flex_attention":
        model.set_attn_implementation("sdpa")
    try:
        with uncompiled(model) if engine == "compiled" else torch.compiler.set_stance("force_eager"):
            yield
    finally:
        if attention == "flex_attention":
            model.set_attn_implementation(attention)
