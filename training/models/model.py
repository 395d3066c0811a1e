"""Build the Hugging Face model a recipe describes: from a config (pretraining) or a checkpoint (fine-tuning)."""
import hashlib
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.integrations import HfDeepSpeedConfig

from training.base.errors import ConfigError
from training.compat.torch import replace_forward
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.config.sections import ModelSection
from training.models.attention import attention_for
from training.models.lora import nf4_quantization
from training.planning.ds_config import zero_stage
from training.planning.precision import DTYPES, device_type, weights_dtype


def load_model_config(section: ModelSection) -> PretrainedConfig:
    """The architecture alone (no weights): cheap enough to check a recipe against before any run."""
    source = section.config or section.name_or_path
    if section.config and not Path(section.config).exists():
        raise ConfigError(f"model.config: no file {section.config}; point it at a model's config.json (or its "
                          f"folder)")
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=section.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model: cannot read a model config from {source}: {error}") from None
    unknown = [key for key in section.config_overrides if not hasattr(config, key)]
    if unknown:
        raise ConfigError(f"model.config_overrides: {', '.join(unknown)} not in {type(config).__name__} "
                          f"(from {source}); check the spelling against its config.json")
    for key, value in section.config_overrides.items():
        try:
            config.update({key: value})
        except (StrictDataclassError, TypeError, ValueError) as error:
            raise ConfigError(f"model.config_overrides.{key}={value!r} does not fit {type(config).__name__}: "
                              f"{str(error).splitlines()[-1].strip()}") from None
    layer_types = getattr(config, "layer_types", None)  # one entry per layer, derived when a config is built (Qwen2)
    if layer_types and len(layer_types) != config.num_hidden_layers and "layer_types" not in section.config_overrides:
        config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "layer_types"})
    # No KV cache while training; and with use_cache=True transformers stops deriving each document's attention
    # mask from position_ids, so packed documents would attend to each other.
    config.use_cache = False
    return config


def check_recipe_against_model(recipe: Recipe, config: PretrainedConfig, vocab_size: int | None) -> None:
    problems = []
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and recipe.data.seq_len > max_positions:
        problems.append(f"data.seq_len={recipe.data.seq_len} is longer than the model's max_position_embeddings="
                        f"{max_positions}; lower data.seq_len")
    if vocab_size is not None and vocab_size > config.vocab_size:
        problems.append(f"the tokenizer ({recipe.tokenizer_path}) has {vocab_size} tokens but the model's "
                        f"vocab_size is {config.vocab_size}; use the model's own tokenizer")
    if problems:
        raise ConfigError(f"{recipe.path}:\n" + "\n".join(f"  {p}" for p in problems))


def load_tokenizer(name_or_path: str, trust_remote_code: bool,
                   cached_only: bool = False) -> PreTrainedTokenizerBase | None:
    """The tokenizer, with a pad token: padded rows (bfd, none) and the exported folder need one. Without
    its own, EOS pads (padding is never a target, so the model is not taught to stop there).

    cached_only (a dry run): a hub tokenizer that is not in the local cache is None, not a download."""
    hub_id = not Path(name_or_path).is_absolute()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                  local_files_only=cached_only)
    except (OSError, ValueError) as error:
        if cached_only and hub_id:
            return None
        raise ConfigError(f"tokenizer: cannot load a tokenizer from {name_or_path}: {error}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


# Config keys that decide the weights' shapes: a shipped model.config must agree with the checkpoint on them.
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def shape_differences(folder: Path, config: PretrainedConfig, trust_remote_code: bool = False) -> list[str]:
    """How the model saved in `folder` (its config.json) differs from `config` in the weights' shapes."""
    try:
        saved = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{folder / 'config.json'} cannot be read ({error})") from None
    return [f"{key} {getattr(saved, key, None)} vs {getattr(config, key, None)}" for key in SHAPE_KEYS
            if getattr(saved, key, None) != getattr(config, key, None)]


def check_checkpoint_matches(config: PretrainedConfig, section: ModelSection) -> None:
    """A recipe that ships the architecture (model.config) and names a local checkpoint (model.name_or_path):
    both must describe the same shapes. (A hub checkpoint is checked when its weights load.)"""
    folder = Path(section.name_or_path)
    if not folder.is_dir():
        return
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.name_or_path={folder} holds weights but no config.json, so they cannot be checked "
                          f"against model.config={section.config}: if they are that model's, copy its config.json "
                          f"into {folder}; or save the checkpoint with save_pretrained, which writes both")
    differ = shape_differences(folder, config, section.trust_remote_code)
    if differ:
        raise ConfigError(f"model.name_or_path={folder} is another architecture than model.config="
                          f"{section.config} ({'; '.join(differ)}): set model.config=null to take the checkpoint's "
                          f"own config, or point model.name_or_path at a checkpoint of this model")


def check_resumed_model(tag_dir: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """The checkpoint to resume holds the model this run builds and was trained with this run's tokenizer (both saved
    in its hf/): else a mismatch (a changed override or tokenizer), which is no damage and is not fixed by resuming
    from another checkpoint. Another tokenizer of the same size would train on silently wrong token ids."""
    if not (tag_dir / "hf" / "config.json").is_file():
        return  # no config saved with it: DeepSpeed's load names any mismatch
    if tokenizer is not None and (tag_dir / "hf" / "tokenizer_config.json").is_file():
        try:
            saved = AutoTokenizer.from_pretrained(tag_dir / "hf")
        except (OSError, ValueError) as error:
            raise ConfigError(f"--resume: the tokenizer saved in {tag_dir / 'hf'} cannot be read ({error}): the "
                              f"checkpoint is damaged; resume from another one") from None
        if saved.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"--resume: {tag_dir} was trained with another tokenizer than this run's "
                              f"({tokenizer.name_or_path}): its token ids mean other text. Resume with the tokenizer "
                              f"that wrote it (saved in {tag_dir / 'hf'}), or start a new run")
    differ = shape_differences(tag_dir / "hf", config)
    if differ:
        raise ConfigError(f"--resume: {tag_dir} holds another model than this run builds (checkpoint vs run: "
                          f"{'; '.join(differ)}). The checkpoint is not damaged: the recipe or its overrides differ "
                          f"from those of the run that wrote it ({tag_dir.parent.parent / 'resolved_recipe.yaml'}); "
                          f"resume with the same model settings, or start a new run from its weights "
                          f"(python -m training export {tag_dir} DIR, then model.name_or_path=DIR)")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_checkpoint_folder(name_or_path: str) -> None:
    """A local checkpoint must exist and hold weights (a hub id is checked when it downloads)."""
    folder = Path(name_or_path)
    if folder.is_absolute() and not folder.is_dir():
        raise ConfigError(f"model.name_or_path: no folder {folder}; train or download the checkpoint first, or "
                          f"point model.name_or_path at a folder written by save_pretrained (or a hub id)")
    if folder.is_dir() and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"model.name_or_path={folder} holds no weights (none of {', '.join(WEIGHT_FILES)}); "
                          f"point it at a folder written by save_pretrained, or use model.config to train from scratch")
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:  # reads the header only, which lists every tensor's place in the file: a file cut short fails here
            with safe_open(path, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ConfigError(f"model.name_or_path={folder}: {path.name} cannot be read ({error}): the checkpoint is "
                              f"damaged or incomplete; download or save it again") from None


SAMPLED_BLOCKS, BLOCK_BYTES = 16, 1 << 16


def weights_digest(name_or_path: str) -> str | None:
    """What identifies a checkpoint's weights without reading all of them: a hash of its config.json and, for each
    weight file, its name, size and 16 blocks of 64 KiB spread over it (training changes nearly every block). A hub
    id counts by its snapshot in the local cache; None where it is not there."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        try:
            folder = Path(snapshot_download(name_or_path, local_files_only=True))
        except (OSError, ValueError, HfHubHTTPError):
            return None
    files = sorted(path for path in folder.iterdir() if path.is_file() and (
        path.suffix in (".safetensors", ".bin") or path.name.endswith(".index.json") or path.name == "config.json"))
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as file:
            for offset in sorted({size * block // SAMPLED_BLOCKS for block in range(SAMPLED_BLOCKS)}):
                file.seek(offset)
                digest.update(file.read(BLOCK_BYTES))
    return digest.hexdigest()[:32]


def from_checkpoint(recipe: Recipe, config: PretrainedConfig, ds_config: dict, dtype: torch.dtype,
                    name_or_path: str | None = None, **options) -> PreTrainedModel:
    """The checkpoint at `name_or_path` (default model.name_or_path) with `config`, the run's attention and
    trust_remote_code, in `dtype`; under a ZeRO-3 `ds_config` loaded inside zero.Init (build_model's docstring),
    partitioned over the ranks."""
    zero3 = HfDeepSpeedConfig(ds_config) if zero_stage(ds_config) == 3 else None  # noqa: F841 (held by a weak reference)
    return AutoModelForCausalLM.from_pretrained(
        name_or_path or recipe.model.name_or_path, config=config, dtype=dtype,
        trust_remote_code=recipe.model.trust_remote_code,
        attn_implementation=attention_for(recipe.model.attn_implementation, config, on_gpu=device_type() == "cuda"),
        **options)


def build_model(recipe: Recipe, config: PretrainedConfig, ds_config: dict, precision: Precision) -> PreTrainedModel:
    """The model, from `model.config` (random weights from the training seed, so that every rank and every
    ZeRO stage starts from the same weights) or from the checkpoint at `model.name_or_path`.

    A checkpoint under ZeRO-3 is loaded inside DeepSpeed's `zero.Init` (transformers does it while an
    `HfDeepSpeedConfig` is alive): every parameter is partitioned across the ranks as it is created and
    the weights are loaded one module at a time, so no rank ever holds the whole model. A model from
    `model.config` is built whole on every rank: under zero.Init transformers initializes the weights in
    another order, so ZeRO-3 would start from other random weights than the other stages."""
    torch.manual_seed(recipe.training.seed)
    if recipe.model.name_or_path:
        quantized = ({"quantization_config": nf4_quantization(DTYPES[precision])} if recipe.lora.quantize == "nf4"
                     else {})
        model = from_checkpoint(recipe, config, ds_config, weights_dtype(precision, zero_stage(ds_config)), **quantized)
    else:
        model = AutoModelForCausalLM.from_config(
            config=config, dtype=torch.float32, trust_remote_code=recipe.model.trust_remote_code,
            attn_implementation=attention_for(recipe.model.attn_implementation, config, on_gpu=device_type() == "cuda"))
    if recipe.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def disable_dropout(model: torch.nn.Module) -> int:
    """Every dropout of the model off, as TRL's disable_dropout turns it off (its nn.Dropout modules at p=0), and
    beyond TRL the attention's own dropout, a float that transformers' attention functions read off the attention
    module (attention_dropout: Llama's, Qwen's, Mistral's). LoRA's dropout on the adapters' input (lora.dropout, a
    setting of its own) stays. Returns how many were on."""
    turned_off = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0 and "lora_dropout" not in name:
            module.p, turned_off = 0.0, turned_off + 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout, turned_off = 0.0, turned_off + 1
    return turned_off


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """The LM head computing in fp32 (ScaleRL's recipe; an objective's setting turns it on): the hidden states, the
    weight and the logits in fp32, so that the log-probabilities an objective compares (e.g. a policy's ratios and KL)
    keep fp32's precision where bf16 logits round them to 8 bits of mantissa. Unlike TRL's, which keeps the head's
    weight in fp32, the weight stays in the engine's dtype (DeepSpeed's bf16 optimizer holds the fp32 master of every
    weight alike) and is cast in each forward pass: a transient fp32 copy of it (4 x vocab x hidden bytes, kept for
    the backward pass), and a tied embedding stays tied. A no-op in an fp32 run. A ConfigError where another module
    has taken the head's place, which the caller prefixes with its setting (the objective's check refuses it first)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        raise ConfigError(f"the model's output layer is a {kind}, not a plain linear layer (LoRA on lm_head, "
                          f"lora.modules_to_save, fp8.lm_head)")

    def forward(self: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(hidden_states.device.type, enabled=False):  # ZeRO-0's bf16: autocast over fp32 weights
            return torch.nn.functional.linear(hidden_states.float(), self.weight.float(), bias)

    replace_forward(head, forward)
