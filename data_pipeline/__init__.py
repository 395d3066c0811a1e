"""Turn a recipe's `data:` section into training-ready packed rows. Never imports DeepSpeed."""


class DataError(ValueError):
    """Bad input data: the message names the file (and line or field) and how to fix it."""
