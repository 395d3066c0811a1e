"""Library code behind train.py, one folder per concern (README.md, Layout): config, planning, models, parallel,
state, loop, and compat (every workaround of upstream internals)."""
import logging

from training.compat import no_mlflow_for_autotuner

# transformers imports torchao (precision: fp8) when it is installed; torchao then tries its prebuilt kernels for
# other torch versions and warns, at every start, that they do not load. Its float8 training does not use them.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

no_mlflow_for_autotuner()
