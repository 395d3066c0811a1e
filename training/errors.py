class ConfigError(ValueError):
    """A recipe, override or DeepSpeed config that cannot run: the message names the file, the key and the fix."""
