"""Library code behind train.py, one folder per concern, in import order (README.md, Layout;
tests/test_import_order.py): base, compat (every workaround of upstream internals), then data_pipeline, config,
planning, models, parallel, state, loop, objectives (one folder each; their specs load with config), trainer.py (the
loop) and checks.py on top."""
import logging

from training.compat import no_mlflow_for_autotuner

# transformers imports torchao (precision: fp8) when it is installed; torchao then tries its prebuilt kernels for
# other torch versions and warns, at every start, that they do not load. Its float8 training does not use them.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

no_mlflow_for_autotuner()
